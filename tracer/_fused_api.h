/* The C interface of tracer._fused, for compiled callers in other extension modules (the op
 * observer, tracer/_observer.cpp): stats() without Python objects or the GIL.
 *
 * `tracer._fused._C_API` is a capsule named FUSED_API_CAPSULE holding a fused_api_t. Its
 * `stats` fills a raw_stats_t with what `tracer._fused.stats` returns, in the same order, for
 * the same arguments (dtype codes 0 float32, 1 bfloat16, 2 float16, 3 int64, 4 int32, 5 int16,
 * 6 int8, 7 uint8 or bool), and answers 0, or -1 for bad arguments or no memory; `copy_stats`
 * the same for a copy it makes, `diff_stats` for a float32 difference, `strided_stats` for a
 * strided tensor without copying it. All may be called from any
 * thread, with or without the GIL. */
#ifndef SLEUTH_FUSED_API_H
#define SLEUTH_FUSED_API_H
#include <stdint.h>

#define FUSED_API_CAPSULE "tracer._fused._C_API"
#define FUSED_API_VERSION 3

typedef struct {
    double mn, mx, sum, sq;
    uint64_t zeros, nan, posinf, neginf, checksum;
} raw_stats_t;

typedef struct {
    int version;
    int (*stats)(const void *address, int64_t count, int code, int threads, raw_stats_t *out);
    /* copy `count` elements from `src` to `dst` and fill `out` with stats() of the copy, in
     * one pass over memory (what `tracer._fused.copy_stats` does; integer codes too) */
    int (*copy_stats)(void *dst, const void *src, int64_t count, int code, int threads,
                      raw_stats_t *out);
    /* float32 only: stats() of the difference a - b, written to `dst` unless it is NULL (it
     * may be `a` or `b`), in one pass (what `tracer._fused.diff_stats` does) */
    int (*diff_stats)(const float *a, const float *b, float *dst, int64_t count, int threads,
                      raw_stats_t *out);
    /* float codes only: stats() of the `count` elements at `address` read with `sizes` and
     * `strides` (`ndim` of each, strides in elements, none negative), equal to the bit to
     * stats() of their contiguous copy, without the copy (one thread) */
    int (*strided_stats)(const void *address, int64_t count, int code, int ndim,
                         const int64_t *sizes, const int64_t *strides, raw_stats_t *out);
} fused_api_t;

#endif

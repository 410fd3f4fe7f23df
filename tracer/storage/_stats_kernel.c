/* tracer.storage._stats_kernel: one-pass tensor statistics over raw memory (see
 * tracer/storage/_stats.py).
 *
 * stats(address, count, code) reads `count` elements at `address` (float32,
 * bfloat16 or float16, by `code`; also int64, int32, int16, int8 and uint8/bool, see int_stats)
 * once and returns
 *     (min, max, sum, sum_of_squares, zeros, nan, posinf, neginf, checksum)
 * with min/max over the non-NaN elements, zeros counting +0 and -0, and checksum the sum of the
 * raw element bits modulo 2**64 (the caller wraps it to the element width). Sums run in float32
 * lanes over short runs, then in float64 per chunk of 64K elements, and chunk results are added
 * in chunk order: the result depends only on the data, not on the instruction set. NaN and Inf are counted in a second pass, run only when the first pass shows they exist
 * (they propagate into the sum or reach min/max). The GIL is released while it runs over 64K
 * elements or more (GIL_FREE_MIN).
 *
 * Fused forms serve the async snapshots and the parameter records (memory cold by step end):
 *     copy_stats(dst, src, count, code)   copies, and returns the statistics of
 *                                                    the copy, chunk by chunk while in cache
 *     copy_stats_into(buffer, src, count, code)   the same into a writable buffer
 *     diff_stats(a, b, out, count)        float32: the statistics of a - b, written
 *                                                    to `out` when it is not 0 (out may be b)
 * Each returns exactly what stats() returns for the resulting tensor. sample() reads a record's
 * sketch: a few elements at given offsets, as float64; record() is stats() finished as a row
 * holds it, with the sketch, in one call (the writer's plain records).
 *
 * The numpy/torch path in _numpy_stats.py makes five passes and ~10 torch calls per chunk;
 * this one pass runs near memory speed. The build is optional (setup.py): without a C compiler
 * the tracer uses that path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { CODE_F32 = 0, CODE_BF16 = 1, CODE_F16 = 2 };
/* integer and bool codes, accepted by stats() only (one scalar pass, see int_stats) */
enum { CODE_I64 = 3, CODE_I32 = 4, CODE_I16 = 5, CODE_I8 = 6, CODE_U8 = 7, CODE_LAST = 7 };
/* VL elements per vector, UNROLL independent vectors per statistic (their dependency chains
 * overlap): LANES accumulators in all */
#define VL 8
#define UNROLL 2
#define LANES (VL * UNROLL)
/* Elements per chunk. Each chunk's sum and sum of squares is reduced on its own and the chunk
 * results are added in chunk order; per-lane 32-bit counters cannot overflow inside one
 * chunk. */
#define CHUNK (1 << 16)
#define STACK_CHUNKS 256
/* Passes over fewer elements keep the GIL (~16 us of float32 at most): releasing it lets a
 * thread that waits for it (the async writer's) run Python, and the caller then waits to take
 * it back, for up to the interpreter's switch interval, far longer than the pass. */
#define GIL_FREE_MIN (1 << 16)
#define RELEASE_GIL_IF(big) PyThreadState *gil_state_ = (big) ? PyEval_SaveThread() : NULL
#define RESTORE_GIL() do { if (gil_state_ != NULL) PyEval_RestoreThread(gil_state_); } while (0)

typedef struct {
    float mn, mx;
    double sum, sq;
    uint64_t zeros, checksum;
} acc_t;

/* what stats() returns, as C values, in the order of its tuple */
typedef struct {
    double mn, mx, sum, sq;
    uint64_t zeros, nan, posinf, neginf, checksum;
} raw_stats_t;

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* IEEE half to float, branch-free so loops over it vectorize: shift exponent and mantissa into
 * place and rebias; Inf/NaN get the full exponent; subnormals are renormalised by a float
 * subtraction. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t exp = em & 0x0f800000u;
    uint32_t normal = em + ((127u - 15u) << 23);
    uint32_t special = normal + ((128u - 16u) << 23);
    float sub = f32_from_bits(em + (113u << 23)) - f32_from_bits(113u << 23);
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, sizeof sub_bits);
    uint32_t out = exp == 0x0f800000u ? special : (exp == 0 ? sub_bits : normal);
    return f32_from_bits(out | sign);
}

/* One pass of min, max, sum, sum of squares, zero count and bit sum over one block, written
 * with GCC/Clang vector extensions (eight lanes; the compiler maps them to whatever SIMD the
 * target has; an AVX2 copy follows below). Lanes are
 * independent accumulators, so no floating-point addition is reordered: the result depends
 * only on the data. Sums run in float32 lanes over runs of SUB elements, then go into double
 * lanes: float32 vectors are twice as wide, and SUB/8 additions per lane keep the float32
 * rounding small. */
#define SUB 512
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));

/* On x86-64 an AVX2 copy of each pass is compiled too and picked at load time (PyInit__stats_kernel);
 * it takes min and max with vminps/vmaxps, which compute exactly `v < m ? v : m` (NaN and
 * signed zeros included) in one instruction where the portable form needs a compare and a
 * blend: 1.7x the portable speed on cached data. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PASS 1
#define AVX2 __attribute__((target("avx2")))
#define vmin_avx2(a, b) ((vf)_mm256_min_ps((__m256)(a), (__m256)(b)))
#define vmax_avx2(a, b) ((vf)_mm256_max_ps((__m256)(a), (__m256)(b)))
#else
#define HAVE_AVX2_PASS 0
#endif
#define PORTABLE

/* Macros, not functions: a helper taking or returning a 32-byte vector would not be inlined
 * into the AVX2 clone (different target), and calling it would cost more than the work. */
#define load_f32_bits(p) ({ vu u_; memcpy(&u_, (p), sizeof u_); u_; })
#define load_h_bits(p) ({ vh h_; memcpy(&h_, (p), sizeof h_); __builtin_convertvector(h_, vu); })
#define as_vf(u) ((vf)(u))
#define bf16v_to_f32(u) ((vf)((u) << 16))
/* the vector form of f16_to_f32 above */
#define f16v_to_f32(h) ({                                                                     \
    vu sign_ = ((h) & 0x8000u) << 16;                                                         \
    vu em_ = ((h) & 0x7fffu) << 13;                                                           \
    vu exp_ = em_ & 0x0f800000u;                                                              \
    vu normal_ = em_ + ((127u - 15u) << 23);                                                  \
    vu special_ = normal_ + ((128u - 16u) << 23);                                             \
    vu sub_ = (vu)((vf)(em_ + (113u << 23)) - (vf)(em_ - em_ + (113u << 23)));               \
    vu is_special_ = (vu)(exp_ == 0x0f800000u);                                               \
    vu is_sub_ = (vu)(exp_ == 0u);                                                            \
    (vf)(((special_ & is_special_) | (sub_ & is_sub_) | (normal_ & ~(is_special_ | is_sub_))) \
         | sign_); })
#define vmin(a, b) ({ vi m_ = (a) < (b); (vf)(((vi)(a) & m_) | ((vi)(b) & ~m_)); })
#define vmax(a, b) ({ vi m_ = (a) > (b); (vf)(((vi)(a) & m_) | ((vi)(b) & ~m_)); })

#define DEFINE_PASS(NAME, ATTR, VMIN, VMAX, ETYPE, LOAD, TO_F32, SCALAR_TO_F32)               \
    ATTR static void NAME(const ETYPE *x, int64_t n, acc_t *acc) {                             \
        vf mn[UNROLL], mx[UNROLL];                                                             \
        vi z[UNROLL];                                                                          \
        vu ck[UNROLL];                                                                         \
        for (int u = 0; u < UNROLL; u++) {                                                     \
            mn[u] = (vf){0} + INFINITY; mx[u] = (vf){0} - INFINITY;                            \
            z[u] = (vi){0}; ck[u] = (vu){0};                                                   \
        }                                                                                      \
        double s[LANES] = {0}, q[LANES] = {0};                                                 \
        int64_t i = 0;                                                                         \
        while (i + LANES <= n) {                                                               \
            int64_t stop = i + SUB <= n ? i + SUB : n - (n - i) % LANES;                       \
            vf fs[UNROLL], fq[UNROLL];                                                         \
            for (int u = 0; u < UNROLL; u++) { fs[u] = (vf){0}; fq[u] = (vf){0}; }             \
            for (; i < stop; i += LANES) {                                                     \
                for (int u = 0; u < UNROLL; u++) {                                             \
                    vu b = LOAD(x + i + u * VL);                                               \
                    vf v = TO_F32(b);                                                          \
                    mn[u] = VMIN(v, mn[u]);                                                    \
                    mx[u] = VMAX(v, mx[u]);                                                    \
                    fs[u] += v;                                                                \
                    vf sq = v * v;                                                             \
                    fq[u] += sq;                                                               \
                    z[u] -= (v == 0.0f);                                                       \
                    ck[u] += b;                                                                \
                }                                                                              \
            }                                                                                  \
            for (int u = 0; u < UNROLL; u++)                                                   \
                for (int j = 0; j < VL; j++) {                                                 \
                    s[u * VL + j] += fs[u][j];                                                 \
                    q[u * VL + j] += fq[u][j];                                                 \
                }                                                                              \
        }                                                                                      \
        float fmn[LANES], fmx[LANES];                                                          \
        uint32_t fz[LANES], fck[LANES];                                                        \
        memcpy(fmn, mn, sizeof fmn); memcpy(fmx, mx, sizeof fmx);                              \
        memcpy(fz, z, sizeof fz); memcpy(fck, ck, sizeof fck);                                 \
        for (int j = 0; i < n; i++, j++) { /* the tail: one element per lane, in order */      \
            float v = SCALAR_TO_F32(x[i]);                                                     \
            fmn[j] = v < fmn[j] ? v : fmn[j];                                                  \
            fmx[j] = v > fmx[j] ? v : fmx[j];                                                  \
            s[j] += (double)v;                                                                 \
            q[j] += (double)v * (double)v;                                                     \
            fz[j] += (v == 0.0f);                                                              \
            fck[j] += (uint32_t)x[i];                                                          \
        }                                                                                      \
        for (int j = 0; j < LANES; j++) {                                                      \
            acc->mn = fmn[j] < acc->mn ? fmn[j] : acc->mn;                                     \
            acc->mx = fmx[j] > acc->mx ? fmx[j] : acc->mx;                                     \
            acc->sum += s[j];                                                                  \
            acc->sq += q[j];                                                                   \
            acc->zeros += fz[j];                                                               \
            acc->checksum += fck[j];                                                           \
        }                                                                                      \
    }

/* Second pass, only when NaN or Inf exist: count them. */
#define DEFINE_COUNT(NAME, ETYPE, TO_F32)                                                      \
    static void NAME(const ETYPE *x, int64_t n, uint64_t *nan, uint64_t *pinf,                 \
                     uint64_t *ninf) {                                                         \
        uint64_t a = 0, b = 0, c = 0;                                                          \
        for (int64_t i = 0; i < n; i++) {                                                      \
            float v = TO_F32(x[i]);                                                            \
            a += v != v;                                                                       \
            b += v == INFINITY;                                                                \
            c += v == -INFINITY;                                                               \
        }                                                                                      \
        *nan = a; *pinf = b; *ninf = c;                                                        \
    }

static inline float f32_identity(uint32_t b) { return f32_from_bits(b); }

DEFINE_PASS(pass_f32, PORTABLE, vmin, vmax, uint32_t, load_f32_bits, as_vf, f32_identity)
DEFINE_PASS(pass_bf16, PORTABLE, vmin, vmax, uint16_t, load_h_bits, bf16v_to_f32, bf16_to_f32)
DEFINE_PASS(pass_f16, PORTABLE, vmin, vmax, uint16_t, load_h_bits, f16v_to_f32, f16_to_f32)
#if HAVE_AVX2_PASS
DEFINE_PASS(pass_f32_avx2, AVX2, vmin_avx2, vmax_avx2, uint32_t, load_f32_bits, as_vf,
            f32_identity)
DEFINE_PASS(pass_bf16_avx2, AVX2, vmin_avx2, vmax_avx2, uint16_t, load_h_bits, bf16v_to_f32,
            bf16_to_f32)
DEFINE_PASS(pass_f16_avx2, AVX2, vmin_avx2, vmax_avx2, uint16_t, load_h_bits, f16v_to_f32,
            f16_to_f32)
#endif
typedef void (*pass_fn)(const void *, int64_t, acc_t *);
/* by dtype code; PyInit__stats_kernel swaps in the AVX2 passes where the CPU has AVX2 */
static pass_fn passes[3] = {(pass_fn)pass_f32, (pass_fn)pass_bf16, (pass_fn)pass_f16};
DEFINE_COUNT(count_f32, uint32_t, f32_identity)
DEFINE_COUNT(count_bf16, uint16_t, bf16_to_f32)
DEFINE_COUNT(count_f16, uint16_t, f16_to_f32)

/* What one call computes: the statistics of `src` (OP_STATS); of a copy of `src` written to
 * `dst` (OP_COPY); or of the float32 difference src - src2, written to `dst`, or when `dst` is
 * NULL to a chunk-sized scratch buffer per thread (OP_DIFF). Copy and difference go chunk by
 * chunk, so the pass reads each chunk while it is still in cache. */
enum { OP_STATS = 0, OP_COPY = 1, OP_DIFF = 2 };
typedef struct {
    const char *src, *src2;
    char *dst;
    int64_t count;
    int code, op;
} work_t;

/* out[i] = a[i] - b[i] for n float32 elements; out may be a or b (same index only) */
static void sub_f32(float *out, const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        x -= y;
        memcpy(out + i, &x, sizeof x);
    }
    for (; i < n; i++) out[i] = a[i] - b[i];
}

/* Chunks [c0, c1) of `w`: min/max/zeros/checksum into `acc`, each chunk's sum and sum of
 * squares into sums[c], sqs[c]. `scratch` holds CHUNK float32 for OP_DIFF without `dst`. */
static void run_chunks(const work_t *w, int64_t c0, int64_t c1, acc_t *acc, double *sums,
                       double *sqs, float *scratch) {
    const size_t width = w->code == CODE_F32 ? 4 : 2;
    pass_fn pass = passes[w->code];
    for (int64_t c = c0; c < c1; c++) {
        int64_t start = c * CHUNK;
        int64_t n = w->count - start < CHUNK ? w->count - start : CHUNK;
        size_t offset = (size_t)start * width;
        const void *p = w->src + offset;
        if (w->op == OP_COPY) {
            memcpy(w->dst + offset, p, (size_t)n * width);
            p = w->dst + offset;
        } else if (w->op == OP_DIFF) {
            float *out = w->dst != NULL ? (float *)(w->dst + offset) : scratch;
            sub_f32(out, (const float *)p, (const float *)(w->src2 + offset), n);
            p = out;
        }
        acc_t part = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
        pass(p, n, &part);
        acc->mn = part.mn < acc->mn ? part.mn : acc->mn;
        acc->mx = part.mx > acc->mx ? part.mx : acc->mx;
        acc->zeros += part.zeros;
        acc->checksum += part.checksum;
        sums[c] = part.sum;
        sqs[c] = part.sq;
    }
}



/* Count NaN, +Inf and -Inf in the values `w` produced: the input, the copy, the written
 * difference, or (a difference into scratch) the difference again, element by element. */
static void count_special(const work_t *w, uint64_t *nan, uint64_t *pinf, uint64_t *ninf) {
    const char *values = w->op == OP_STATS ? w->src : w->dst;
    int64_t count = w->count;
    if (values == NULL) {
        const float *a = (const float *)w->src, *b = (const float *)w->src2;
        uint64_t n = 0, p = 0, m = 0;
        for (int64_t i = 0; i < count; i++) {
            float v = a[i] - b[i];
            n += v != v;
            p += v == INFINITY;
            m += v == -INFINITY;
        }
        *nan = n; *pinf = p; *ninf = m;
    } else if (w->code == CODE_F32) {
        count_f32((const uint32_t *)values, count, nan, pinf, ninf);
    } else if (w->code == CODE_BF16) {
        count_bf16((const uint16_t *)values, count, nan, pinf, ninf);
    } else {
        count_f16((const uint16_t *)values, count, nan, pinf, ninf);
    }
}

/* The statistics of `w` into `out`, or -1
 * when memory for the per-chunk sums ran out. Touches no Python state: the caller decides
 * about the GIL (run_work releases it). */
static int compute_work(const work_t *w, raw_stats_t *out) {
    int64_t count = w->count;
    int64_t nchunks = (count + CHUNK - 1) / CHUNK;
    double stack_sums[STACK_CHUNKS], stack_sqs[STACK_CHUNKS];
    double *sums = stack_sums, *sqs = stack_sqs;
    if (nchunks > STACK_CHUNKS) {
        sums = PyMem_RawMalloc(sizeof(double) * (size_t)nchunks * 2);
        if (sums == NULL) return -1;
        sqs = sums + nchunks;
    }
    float *scratch = NULL;
    if (w->op == OP_DIFF && w->dst == NULL) {
        scratch = PyMem_RawMalloc(sizeof(float) * CHUNK * 2);
        if (scratch == NULL) {
            if (sums != stack_sums) PyMem_RawFree(sums);
            return -1;
        }
    }
    acc_t acc = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
    uint64_t nan = 0, pinf = 0, ninf = 0;
    run_chunks(w, 0, nchunks, &acc, sums, sqs, scratch);
    for (int64_t c = 0; c < nchunks; c++) { /* chunk order */
        acc.sum += sums[c];
        acc.sq += sqs[c];
    }
    /* NaN makes the sum NaN; Inf reaches min or max (or makes the sum NaN as +Inf + -Inf) */
    if (isnan(acc.sum) || isinf(acc.mn) || isinf(acc.mx)) count_special(w, &nan, &pinf, &ninf);
    if (sums != stack_sums) PyMem_RawFree(sums);
    PyMem_RawFree(scratch);
    *out = (raw_stats_t){(double)acc.mn, (double)acc.mx, acc.sum, acc.sq, acc.zeros, nan, pinf,
                         ninf, acc.checksum};
    return 0;
}

static PyObject *result_tuple(const raw_stats_t *r) {
    return Py_BuildValue("ddddKKKKK", r->mn, r->mx, r->sum, r->sq,
                         (unsigned long long)r->zeros, (unsigned long long)r->nan,
                         (unsigned long long)r->posinf, (unsigned long long)r->neginf,
                         (unsigned long long)r->checksum);
}

/* Runs `w` (GIL released when it is large) and builds the result tuple. */
static PyObject *run_work(const work_t *w) {
    raw_stats_t r;
    RELEASE_GIL_IF(w->count >= GIL_FREE_MIN);
    int status = compute_work(w, &r);
    RESTORE_GIL();
    if (status < 0) return PyErr_NoMemory();
    return result_tuple(&r);
}

/* 0, or -1 with a ValueError naming `fn`; `second` (the copy's destination, the difference's
 * subtrahend, named `second_name`) must be non-null unless `second_name` is NULL. `last_code`:
 * the highest dtype code `fn` takes (CODE_F16 for the one-pass float forms, CODE_LAST for
 * stats()). */
static int check_args(unsigned long long address, long long count, int code, int last_code,
                      const char *fn, unsigned long long second, const char *second_name) {
    if (count < 1 || address == 0) {
        PyErr_Format(PyExc_ValueError, "%s() needs a non-null address and count >= 1", fn);
        return -1;
    }
    if (second_name != NULL && second == 0) {
        PyErr_Format(PyExc_ValueError, "%s() needs a non-null %s", fn, second_name);
        return -1;
    }
    if (code < CODE_F32 || code > last_code) {
        PyErr_Format(PyExc_ValueError, "%s(): unknown dtype code %d", fn, code);
        return -1;
    }
    return 0;
}

/* Integer and bool tensors (ids, labels, masks, counts): one scalar pass the compiler
 * vectorizes. min and max are exact and then converted to double (conversion is monotonic, so
 * this equals the min of the converted values, as the numpy path takes it); the sum is exact in
 * 128 bits and rounded once; the sum of squares runs in double in element order; the
 * checksum is the raw bits summed modulo 2**64, as for floats (the caller wraps it to the
 * element width). Nothing is NaN or infinite. */
typedef struct {
    double mn, mx, sum, sq;
    uint64_t zeros, checksum;
} int_acc_t;

#define DEFINE_INT_PASS(NAME, ETYPE, UTYPE)                                                    \
    static void NAME(const ETYPE *x, int64_t n, int_acc_t *out) {                              \
        ETYPE lo = x[0], hi = x[0];                                                            \
        __int128 s = 0;                                                                        \
        double q = 0.0;                                                                        \
        uint64_t z = 0, ck = 0;                                                                \
        for (int64_t i = 0; i < n; i++) {                                                      \
            ETYPE v = x[i];                                                                    \
            lo = v < lo ? v : lo;                                                              \
            hi = v > hi ? v : hi;                                                              \
            s += v;                                                                            \
            q += (double)v * (double)v;                                                        \
            z += v == 0;                                                                       \
            ck += (uint64_t)(UTYPE)v;                                                          \
        }                                                                                      \
        *out = (int_acc_t){(double)lo, (double)hi, (double)s, q, z, ck};                       \
    }
DEFINE_INT_PASS(int_pass_i64, int64_t, uint64_t)
DEFINE_INT_PASS(int_pass_i32, int32_t, uint32_t)
DEFINE_INT_PASS(int_pass_i16, int16_t, uint16_t)
DEFINE_INT_PASS(int_pass_i8, int8_t, uint8_t)
DEFINE_INT_PASS(int_pass_u8, uint8_t, uint8_t)

static void int_compute(const char *src, int64_t count, int code, raw_stats_t *out) {
    int_acc_t r;
    switch (code) {
    case CODE_I64: int_pass_i64((const int64_t *)src, count, &r); break;
    case CODE_I32: int_pass_i32((const int32_t *)src, count, &r); break;
    case CODE_I16: int_pass_i16((const int16_t *)src, count, &r); break;
    case CODE_I8: int_pass_i8((const int8_t *)src, count, &r); break;
    default: int_pass_u8((const uint8_t *)src, count, &r); break;
    }
    *out = (raw_stats_t){r.mn, r.mx, r.sum, r.sq, r.zeros, 0, 0, 0, r.checksum};
}

static PyObject *int_stats(const char *src, int64_t count, int code) {
    raw_stats_t r;
    RELEASE_GIL_IF(count >= GIL_FREE_MIN);
    int_compute(src, count, code, &r);
    RESTORE_GIL();
    return result_tuple(&r);
}

/* A strided tensor's elements in C order (the order of a contiguous copy), read a piece at a
 * time: dims of size 1 dropped, dims that continue each other merged, the innermost run copied
 * with memcpy when it is dense. */
#define GATHER_MAX_DIMS 16
typedef struct {
    const char *base;
    size_t width;
    int ndim;
    int64_t sizes[GATHER_MAX_DIMS], strides[GATHER_MAX_DIMS]; /* in elements */
    int64_t index[GATHER_MAX_DIMS];
    int64_t offset; /* of the next element, in elements */
} gather_t;

static int gather_init(gather_t *g, const void *base, size_t width, int ndim,
                       const int64_t *sizes, const int64_t *strides) {
    if (ndim < 0 || ndim > GATHER_MAX_DIMS) return -1;
    g->base = (const char *)base;
    g->width = width;
    g->ndim = 0;
    g->offset = 0;
    for (int k = 0; k < ndim; k++) {
        if (sizes[k] < 0 || strides[k] < 0) return -1;
        if (sizes[k] == 1) continue;
        int d = g->ndim;
        if (d > 0 && g->strides[d - 1] == sizes[k] * strides[k]) { /* continues the last */
            g->sizes[d - 1] *= sizes[k];
            g->strides[d - 1] = strides[k];
            continue;
        }
        g->sizes[d] = sizes[k];
        g->strides[d] = strides[k];
        g->index[d] = 0;
        g->ndim++;
    }
    if (g->ndim == 0) { /* one element */
        g->sizes[0] = 1;
        g->strides[0] = 1;
        g->index[0] = 0;
        g->ndim = 1;
    }
    return 0;
}

/* Dim `d` and those inside it are done: step dim d-1 on, carrying outwards. */
static void gather_carry(gather_t *g, int d) {
    for (; d >= 0; d--) {
        g->offset -= g->sizes[d] * g->strides[d];
        g->index[d] = 0;
        if (d == 0) return;
        g->index[d - 1]++;
        g->offset += g->strides[d - 1];
        if (g->index[d - 1] < g->sizes[d - 1]) return;
    }
}

/* Copy the next `n` elements into `dst`. */
static void gather_next(gather_t *g, char *dst, int64_t n) {
    const int last = g->ndim - 1;
    const int64_t inner = g->sizes[last], step = g->strides[last];
    const size_t width = g->width;
    while (n > 0) {
        if (step == 1 && last >= 1 && g->index[last] == 0 && n >= inner) {
            /* whole dense rows of the innermost dim: one tight loop over the next dim */
            const int64_t outer = g->strides[last - 1];
            int64_t rows = g->sizes[last - 1] - g->index[last - 1];
            if (rows > n / inner) rows = n / inner;
            const size_t bytes = (size_t)inner * width, skip = (size_t)outer * width;
            const char *src = g->base + (size_t)g->offset * width;
            if (bytes % 16 == 0 && bytes <= 256) {
                for (int64_t r = 0; r < rows; r++, src += skip, dst += bytes)
                    for (size_t i = 0; i < bytes; i += 16) memcpy(dst + i, src + i, 16);
            } else {
                for (int64_t r = 0; r < rows; r++, src += skip, dst += bytes)
                    memcpy(dst, src, bytes);
            }
            n -= rows * inner;
            g->index[last - 1] += rows;
            g->offset += rows * outer;
            if (g->index[last - 1] == g->sizes[last - 1]) gather_carry(g, last - 1);
            continue;
        }
        int64_t left = inner - g->index[last];
        int64_t take = left < n ? left : n;
        const char *src = g->base + (size_t)g->offset * width;
        if (step == 1) {
            memcpy(dst, src, (size_t)take * width);
        } else if (width == 4) {
            for (int64_t i = 0; i < take; i++)
                memcpy(dst + (size_t)i * 4, src + (size_t)(i * step) * 4, 4);
        } else {
            for (int64_t i = 0; i < take; i++)
                memcpy(dst + (size_t)i * 2, src + (size_t)(i * step) * 2, 2);
        }
        dst += (size_t)take * width;
        n -= take;
        g->index[last] += take;
        g->offset += take * step;
        if (g->index[last] < inner) break;
        gather_carry(g, last);
    }
}

/* strided_stats()'s pass: stats() of the float tensor at `address` with `sizes` and
 * `strides` (in elements, none negative) as a contiguous copy of it would give, to the bit:
 * the same chunks, each gathered into a buffer of CHUNK elements and measured by the same
 * pass, their sums combined in the same order. One thread; no copy of the whole tensor. */
static int raw_strided_stats(const void *address, int64_t count, int code, int ndim,
                             const int64_t *sizes, const int64_t *strides, raw_stats_t *out) {
    if (address == NULL || count < 1 || code < CODE_F32 || code > CODE_F16) return -1;
    const size_t width = code == CODE_F32 ? 4 : 2;
    gather_t g;
    if (gather_init(&g, address, width, ndim, sizes, strides) < 0) return -1;
    int64_t total = 1;
    for (int d = 0; d < g.ndim; d++) total *= g.sizes[d];
    if (total != count) return -1;
    static _Thread_local char *buffer = NULL; /* CHUNK elements of 4 bytes, kept per thread */
    if (buffer == NULL && (buffer = PyMem_RawMalloc((size_t)CHUNK * 4)) == NULL) return -1;
    pass_fn pass = passes[code];
    acc_t acc = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
    uint64_t nan = 0, pinf = 0, ninf = 0;
    for (int64_t start = 0; start < count; start += CHUNK) { /* chunk order, as compute_work */
        int64_t n = count - start < CHUNK ? count - start : CHUNK;
        gather_next(&g, buffer, n);
        acc_t part = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
        pass(buffer, n, &part);
        acc.mn = part.mn < acc.mn ? part.mn : acc.mn;
        acc.mx = part.mx > acc.mx ? part.mx : acc.mx;
        acc.zeros += part.zeros;
        acc.checksum += part.checksum;
        acc.sum += part.sum;
        acc.sq += part.sq;
        /* NaN or Inf in this chunk (the test compute_work makes for the whole): counted while
         * the chunk is in the buffer */
        if (isnan(part.sum) || isinf(part.mn) || isinf(part.mx)) {
            work_t w = {buffer, NULL, NULL, n, code, OP_STATS};
            uint64_t a = 0, b = 0, c = 0;
            count_special(&w, &a, &b, &c);
            nan += a; pinf += b; ninf += c;
        }
    }
    *out = (raw_stats_t){(double)acc.mn, (double)acc.mx, acc.sum, acc.sq, acc.zeros, nan, pinf,
                         ninf, acc.checksum};
    return 0;
}

static PyObject *kernel_strided_stats(PyObject *self, PyObject *args) {
    unsigned long long address;
    long long count;
    int code;
    PyObject *sizes_obj, *strides_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLiOO", &address, &count, &code, &sizes_obj, &strides_obj))
        return NULL;
    int64_t sizes[GATHER_MAX_DIMS], strides[GATHER_MAX_DIMS];
    Py_ssize_t ndim = PySequence_Size(sizes_obj);
    if (ndim < 0 || ndim > GATHER_MAX_DIMS || PySequence_Size(strides_obj) != ndim) {
        PyErr_SetString(PyExc_ValueError, "strided_stats: sizes and strides of one length, "
                        "at most 16 dims");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < ndim; k++) {
        PyObject *a = PySequence_GetItem(sizes_obj, k), *b = PySequence_GetItem(strides_obj, k);
        sizes[k] = a ? PyLong_AsLongLong(a) : -1;
        strides[k] = b ? PyLong_AsLongLong(b) : -1;
        Py_XDECREF(a);
        Py_XDECREF(b);
        if (PyErr_Occurred()) return NULL;
    }
    raw_stats_t r;
    int status;
    RELEASE_GIL_IF(count >= GIL_FREE_MIN);
    status = raw_strided_stats((const void *)(uintptr_t)address, count, code, (int)ndim, sizes,
                               strides, &r);
    RESTORE_GIL();
    if (status < 0) {
        PyErr_SetString(PyExc_ValueError, "strided_stats: a float code (0-2), count equal to "
                        "the product of sizes, and strides >= 0");
        return NULL;
    }
    return result_tuple(&r);
}

static PyObject *kernel_stats(PyObject *self, PyObject *args) {
    unsigned long long address;
    long long count;
    int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLi", &address, &count, &code)) return NULL;
    if (check_args(address, count, code, CODE_LAST, "stats", 0, NULL) < 0) return NULL;
    if (code >= CODE_I64) return int_stats((const char *)(uintptr_t)address, count, code);
    work_t w = {(const char *)(uintptr_t)address, NULL, NULL, count, code, OP_STATS};
    return run_work(&w);
}

static PyObject *kernel_copy_stats(PyObject *self, PyObject *args) {
    unsigned long long dst, src;
    long long count;
    int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKLi", &dst, &src, &count, &code)) return NULL;
    if (check_args(src, count, code, CODE_F16, "copy_stats", dst, "destination") < 0)
        return NULL;
    work_t w = {(const char *)(uintptr_t)src, NULL, (char *)(uintptr_t)dst, count, code, OP_COPY};
    return run_work(&w);
}

/* copy_stats with the destination given as a writable buffer (a numpy array): its address
 * without a ctypes object (1.4 us a call), and its size checked */
static PyObject *kernel_copy_stats_into(PyObject *self, PyObject *args) {
    Py_buffer dst;
    unsigned long long src;
    long long count;
    int code;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*KLi", &dst, &src, &count, &code)) return NULL;
    PyObject *result = NULL;
    if (check_args(src, count, code, CODE_F16, "copy_stats_into", (uintptr_t)dst.buf,
                   "destination") == 0) {
        if ((long long)dst.len < count * (code == CODE_F32 ? 4 : 2))
            PyErr_Format(PyExc_ValueError, "copy_stats_into(): the destination holds %zd bytes, "
                         "fewer than %lld elements", dst.len, count);
        else {
            work_t w = {(const char *)(uintptr_t)src, NULL, (char *)dst.buf, count, code,
                        OP_COPY};
            result = run_work(&w);
        }
    }
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *kernel_diff_stats(PyObject *self, PyObject *args) {
    unsigned long long a, b, out;
    long long count;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKL", &a, &b, &out, &count)) return NULL;
    if (check_args(a, count, CODE_F32, CODE_F16, "diff_stats", b, "subtrahend") < 0) return NULL;
    work_t w = {(const char *)(uintptr_t)a, (const char *)(uintptr_t)b, (char *)(uintptr_t)out,
                count, CODE_F32, OP_DIFF};
    return run_work(&w);
}

/* The elements at `n` element offsets `where` from `base` (-1: none, NaN) as float64 into
 * `values`: a record's sketch (tracer/storage/_sketch.py). */
static void sample_into(const char *base, int code, const int64_t *where, Py_ssize_t n,
                        double *values) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = where[i];
        double v = NAN;
        if (k >= 0) {
            switch (code) {
            case CODE_F32: { float f; memcpy(&f, base + 4 * k, 4); v = f; break; }
            case CODE_BF16: { uint16_t h; memcpy(&h, base + 2 * k, 2); v = bf16_to_f32(h); break; }
            case CODE_F16: { uint16_t h; memcpy(&h, base + 2 * k, 2); v = f16_to_f32(h); break; }
            case CODE_I64: { int64_t x; memcpy(&x, base + 8 * k, 8); v = (double)x; break; }
            case CODE_I32: { int32_t x; memcpy(&x, base + 4 * k, 4); v = x; break; }
            case CODE_I16: { int16_t x; memcpy(&x, base + 2 * k, 2); v = x; break; }
            case CODE_I8: v = (int8_t)base[k]; break;
            default: v = (uint8_t)base[k]; break;
            }
        }
        values[i] = v;
    }
}

/* A sketch as bytes of float64 (see sample_into), or NULL with an exception set. */
static PyObject *sketch_bytes(unsigned long long address, int code, const Py_buffer *offsets) {
    Py_ssize_t n = offsets->len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out != NULL)
        sample_into((const char *)(uintptr_t)address, code, (const int64_t *)offsets->buf, n,
                    (double *)PyBytes_AS_STRING(out));
    return out;
}

/* sample(address, code, offsets) -> bytes: the elements at `offsets` (a buffer of int64 element
 * offsets from `address`, -1 for none) as float64, NaN where the offset is -1. Codes as for
 * stats(); the sketch of a record (tracer/storage/_sketch.py) in one call, without a copy. */
static PyObject *kernel_sample(PyObject *self, PyObject *args) {
    unsigned long long address;
    int code;
    Py_buffer offsets;
    (void)self;
    if (!PyArg_ParseTuple(args, "Kiy*", &address, &code, &offsets)) return NULL;
    if (code < 0 || code > CODE_LAST || offsets.len % 8 != 0 || address == 0) {
        PyBuffer_Release(&offsets);
        PyErr_SetString(PyExc_ValueError, "sample: a code 0-7, a non-null address and int64 "
                        "offsets");
        return NULL;
    }
    PyObject *out = sketch_bytes(address, code, &offsets);
    PyBuffer_Release(&offsets);
    return out;
}

/* diff_sample(a, b, offsets) -> bytes: the sketch of the float32 difference a - b without
 * making it: at each int64 element offset (-1: NaN) the two float32 elements subtracted as
 * float32 subtraction rounds, as float64 (the parameter update's sketch). */
static PyObject *kernel_diff_sample(PyObject *self, PyObject *args) {
    unsigned long long a, b;
    Py_buffer offsets;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKy*", &a, &b, &offsets)) return NULL;
    if (offsets.len % 8 != 0 || a == 0 || b == 0) {
        PyBuffer_Release(&offsets);
        PyErr_SetString(PyExc_ValueError, "diff_sample: two non-null addresses and int64 "
                        "offsets");
        return NULL;
    }
    Py_ssize_t n = offsets.len / 8;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out != NULL) {
        double *values = (double *)PyBytes_AS_STRING(out);
        const int64_t *where = (const int64_t *)offsets.buf;
        const char *pa = (const char *)(uintptr_t)a, *pb = (const char *)(uintptr_t)b;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t k = where[i];
            double v = NAN;
            if (k >= 0) {
                float fa, fb;
                memcpy(&fa, pa + 4 * k, 4);
                memcpy(&fb, pb + 4 * k, 4);
                float d = fa - fb;
                v = d;
            }
            values[i] = v;
        }
    }
    PyBuffer_Release(&offsets);
    return out;
}

/* bits of an element of each code: the width its checksum wraps to */
static const int code_bits[CODE_LAST + 1] = {32, 16, 16, 64, 32, 16, 8, 8};

/* record(address, count, code, offsets) -> (min, max, mean, norm, nan, posinf, neginf, zeros,
 * checksum, sketch): a plain record's statistics as its row holds them, in one call. stats()
 * finished as the writer finishes it (tracer.storage._stats._kernel_dict): mean = sum / count,
 * norm = sqrt(sum of squares), min, max, mean and norm NaN where any element is, the checksum
 * wrapped to the element's width as a signed integer; and the sketch of sample(address, code,
 * offsets), or None when offsets is None. */
static PyObject *kernel_record(PyObject *self, PyObject *args) {
    unsigned long long address;
    long long count;
    int code;
    PyObject *offsets_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLiO", &address, &count, &code, &offsets_obj)) return NULL;
    if (check_args(address, count, code, CODE_LAST, "record", 0, NULL) < 0) return NULL;
    Py_buffer offsets;
    int with_sketch = offsets_obj != Py_None;
    if (with_sketch) {
        if (PyObject_GetBuffer(offsets_obj, &offsets, PyBUF_SIMPLE) < 0) return NULL;
        if (offsets.len % 8 != 0) {
            PyBuffer_Release(&offsets);
            PyErr_SetString(PyExc_ValueError, "record: offsets of int64");
            return NULL;
        }
    }
    raw_stats_t r;
    int status = 0;
    if (code >= CODE_I64) {
        RELEASE_GIL_IF(count >= GIL_FREE_MIN);
        int_compute((const char *)(uintptr_t)address, count, code, &r);
        RESTORE_GIL();
    } else {
        work_t w = {(const char *)(uintptr_t)address, NULL, NULL, count, code, OP_STATS};
        RELEASE_GIL_IF(count >= GIL_FREE_MIN);
        status = compute_work(&w, &r);
        RESTORE_GIL();
    }
    if (status < 0) {
        if (with_sketch) PyBuffer_Release(&offsets);
        return PyErr_NoMemory();
    }
    PyObject *sketch = Py_None;
    if (with_sketch) {
        sketch = sketch_bytes(address, code, &offsets);
        PyBuffer_Release(&offsets);
        if (sketch == NULL) return NULL;
    } else {
        Py_INCREF(sketch);
    }
    double mn = r.mn, mx = r.mx, mean = r.sum / (double)count, norm = sqrt(r.sq);
    if (r.nan) mn = mx = mean = norm = Py_NAN;
    int bits = code_bits[code];
    long long checksum;
    switch (bits) {
    case 8: checksum = (int8_t)(uint8_t)r.checksum; break;
    case 16: checksum = (int16_t)(uint16_t)r.checksum; break;
    case 32: checksum = (int32_t)(uint32_t)r.checksum; break;
    default: checksum = (long long)(int64_t)r.checksum; break;
    }
    return Py_BuildValue("ddddKKKKLN", mn, mx, mean, norm, (unsigned long long)r.nan,
                         (unsigned long long)r.posinf, (unsigned long long)r.neginf,
                         (unsigned long long)r.zeros, checksum, sketch);
}

/* tracer/storage/_table.c */
PyObject *kernel_pack_rows(PyObject *self, PyObject *args);

static PyMethodDef methods[] = {
    {"stats", kernel_stats, METH_VARARGS,
     "stats(address, count, code) -> (min, max, sum, sumsq, zeros, nan, posinf, neginf, "
     "checksum); code 0 float32, 1 bfloat16, 2 float16, 3 int64, 4 int32, 5 int16, 6 int8, "
     "7 uint8 or bool (integers: nothing NaN)"},
    {"strided_stats", kernel_strided_stats, METH_VARARGS,
     "strided_stats(address, count, code, sizes, strides) -> stats() of the float tensor "
     "(codes 0-2) read with these sizes and strides (in elements), equal to the bit to stats() "
     "of its contiguous copy, without making the copy"},
    {"copy_stats_into", kernel_copy_stats_into, METH_VARARGS,
     "copy_stats_into(dst_buffer, src, count, code): copy_stats into a writable "
     "buffer of at least count elements"},
    {"copy_stats", kernel_copy_stats, METH_VARARGS,
     "copy_stats(dst, src, count, code): copy count elements from src to dst and "
     "return stats() of them, computed chunk by chunk while cached"},
    {"diff_stats", kernel_diff_stats, METH_VARARGS,
     "diff_stats(a, b, out, count): stats() of the float32 difference a - b, "
     "written to out unless out is 0 (out may be a or b)"},
    {"sample", kernel_sample, METH_VARARGS,
     "sample(address, code, offsets) -> bytes of float64: the elements at these int64 element "
     "offsets (-1: NaN), codes as for stats()"},
    {"diff_sample", kernel_diff_sample, METH_VARARGS,
     "diff_sample(a, b, offsets) -> bytes of float64: the sketch of the float32 difference "
     "a - b at these int64 element offsets (-1: NaN), each rounded as float32"},
    {"record", kernel_record, METH_VARARGS,
     "record(address, count, code, offsets) -> (min, max, mean, norm, nan, posinf, neginf, "
     "zeros, checksum, sketch): stats() as a record's row holds them (NaN statistics where an "
     "element is NaN, the checksum wrapped to the element's width, signed) and sample()'s "
     "sketch, or None for offsets None"},
    {"pack_rows", kernel_pack_rows, METH_VARARGS,
     "pack_rows(rows, kinds) -> (bytearray, widths) or None: a step file's table from its row "
     "tuples (tracer/storage/_table.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stats_kernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit__stats_kernel(void) {
#if HAVE_AVX2_PASS
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        passes[CODE_F32] = (pass_fn)pass_f32_avx2;
        passes[CODE_BF16] = (pass_fn)pass_bf16_avx2;
        passes[CODE_F16] = (pass_fn)pass_f16_avx2;
    }
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    return m;
}

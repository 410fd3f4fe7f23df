/* tracer._fused: one-pass tensor statistics over raw memory (see tracer/_stats.py).
 *
 * stats(address, count, code) reads `count` elements at `address` (float32, bfloat16 or
 * float16, by `code`) once and returns
 *     (min, max, sum, sum_of_squares, zeros, nan, posinf, neginf, checksum)
 * with min/max over the non-NaN elements, sums accumulated in double precision in a fixed lane
 * order (the result depends only on the data, not on threads or chunking), zeros counting +0
 * and -0, and checksum the sum of the raw element bits modulo 2**64 (the caller wraps it to the
 * element width). NaN and Inf are counted in a second pass, run only when the first pass shows
 * they exist (they propagate into the sum or reach min/max). The GIL is released while it runs.
 *
 * The numpy/torch path in _stats.py makes five passes and ~10 torch calls per chunk; this one
 * pass runs near memory speed. The build is optional (setup.py): without a C compiler the
 * tracer uses that path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { CODE_F32 = 0, CODE_BF16 = 1, CODE_F16 = 2 };
/* VL elements per vector, UNROLL independent vectors per statistic (their dependency chains
 * overlap): LANES accumulators in all */
#define VL 8
#define UNROLL 2
#define LANES (VL * UNROLL)
/* elements per block: per-lane 32-bit counters cannot overflow inside one block */
#define BLOCK (1 << 24)

typedef struct {
    float mn, mx;
    double sum, sq;
    uint64_t zeros, checksum;
} acc_t;

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
 * target has, and an AVX2 clone is picked at load time where the CPU has it). Lanes are
 * independent accumulators, so no floating-point addition is reordered: the result depends
 * only on the data. Sums run in float32 lanes over runs of SUB elements, then go into double
 * lanes: float32 vectors are twice as wide, and SUB/8 additions per lane keep the float32
 * rounding small. */
#define SUB 512
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__ELF__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

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

#define DEFINE_PASS(NAME, ETYPE, LOAD, TO_F32, SCALAR_TO_F32)                                  \
    CLONES static void NAME(const ETYPE *x, int64_t n, acc_t *acc) {                           \
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
                    mn[u] = vmin(v, mn[u]);                                                    \
                    mx[u] = vmax(v, mx[u]);                                                    \
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

DEFINE_PASS(pass_f32, uint32_t, load_f32_bits, as_vf, f32_identity)
DEFINE_PASS(pass_bf16, uint16_t, load_h_bits, bf16v_to_f32, bf16_to_f32)
DEFINE_PASS(pass_f16, uint16_t, load_h_bits, f16v_to_f32, f16_to_f32)
DEFINE_COUNT(count_f32, uint32_t, f32_identity)
DEFINE_COUNT(count_bf16, uint16_t, bf16_to_f32)
DEFINE_COUNT(count_f16, uint16_t, f16_to_f32)

static PyObject *fused_stats(PyObject *self, PyObject *args) {
    unsigned long long address;
    long long count;
    int code;
    if (!PyArg_ParseTuple(args, "KLi", &address, &count, &code))
        return NULL;
    if (count < 1 || address == 0) {
        PyErr_SetString(PyExc_ValueError, "stats() needs a non-null address and count >= 1");
        return NULL;
    }
    if (code != CODE_F32 && code != CODE_BF16 && code != CODE_F16) {
        PyErr_Format(PyExc_ValueError, "stats(): unknown dtype code %d", code);
        return NULL;
    }
    acc_t acc = {INFINITY, -INFINITY, 0.0, 0.0, 0, 0};
    uint64_t nan = 0, pinf = 0, ninf = 0;
    const size_t width = code == CODE_F32 ? 4 : 2;
    const char *base = (const char *)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t start = 0; start < count; start += BLOCK) {
        int64_t n = count - start < BLOCK ? count - start : BLOCK;
        const void *p = base + (size_t)start * width;
        if (code == CODE_F32) pass_f32((const uint32_t *)p, n, &acc);
        else if (code == CODE_BF16) pass_bf16((const uint16_t *)p, n, &acc);
        else pass_f16((const uint16_t *)p, n, &acc);
    }
    /* NaN makes the sum NaN; Inf reaches min or max (or makes the sum NaN as +Inf + -Inf) */
    if (isnan(acc.sum) || isinf(acc.mn) || isinf(acc.mx)) {
        if (code == CODE_F32) count_f32((const uint32_t *)base, count, &nan, &pinf, &ninf);
        else if (code == CODE_BF16) count_bf16((const uint16_t *)base, count, &nan, &pinf, &ninf);
        else count_f16((const uint16_t *)base, count, &nan, &pinf, &ninf);
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("ddddKKKKK", (double)acc.mn, (double)acc.mx, acc.sum, acc.sq,
                         (unsigned long long)acc.zeros, (unsigned long long)nan,
                         (unsigned long long)pinf, (unsigned long long)ninf,
                         (unsigned long long)acc.checksum);
}

static PyMethodDef methods[] = {
    {"stats", fused_stats, METH_VARARGS,
     "stats(address, count, code) -> (min, max, sum, sumsq, zeros, nan, posinf, neginf, "
     "checksum); code 0 float32, 1 bfloat16, 2 float16"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }

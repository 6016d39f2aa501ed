/* Native kernels for GGUF blocks: few-row products with 8-bit activations and integer dot products (AVX512-VNNI,
   AVX-VNNI, or AVX2), the same with float32 products for float weights (F32, F16, BF16), and dequantization of the
   quantized kinds to float32 or bfloat16 for prefill GEMMs (vector rows at each level for the per-32 kinds and Q6_K,
   scalar rows the compiler vectorizes for Q4_K and Q5_K; the same bits either way).

   Built without -march flags: every SIMD function is compiled for its own CPU level (`#pragma GCC target`) and
   chosen at run time (`level`). Rows of the weight are spread over OpenMP threads; imported after torch, the
   module shares torch's libgomp (same soname), so its threads are torch's. Python passes data pointers of
   contiguous CPU tensors it owns and checked (kernels/native.py); the GIL is released while computing. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1, K_Q8_0, K_Q4_K, K_Q5_K, K_Q6_K, K_F32, K_F16, K_BF16, K_COUNT };
static const int BLOCK[K_COUNT] = {32, 32, 32, 32, 32, 256, 256, 256, 8, 8, 8};  /* float kinds: 8 weights a step */
static const int BYTES[K_COUNT] = {18, 20, 22, 24, 34, 144, 176, 210, 32, 16, 16};

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8  /* software prefetch this many rows ahead: more reads in flight than the streams' prefetchers keep */
#endif

static inline int is_k(int kind) { return kind >= K_Q4_K && kind <= K_Q6_K; }
static inline int is_float(int kind) { return kind >= K_F32; }

struct gemv {
    int kind, x_bf16, out_bf16;
    const uint8_t *w;
    int64_t row_bytes, rows, cols, n;
    const void *x;
    void *out;
    const float *bias;
    float *xf;  /* float weights: the activations as float32 (scratch) */
    int8_t *q;  /* quantized weights: the activations quantized, with their scales and sums (scratch) */
    float *d;
    int16_t *s16;
    int32_t *s32;
};

static inline __attribute__((always_inline)) uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* A float16 as float32, exactly (subnormals, infinities and NaN payloads kept), as gguf reads a block's scale. */
static inline __attribute__((always_inline)) float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else {  /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void put(const struct gemv *g, int64_t i, int64_t r, float v) {
    if (g->bias) v += g->bias[r];
    if (g->out_bf16) ((uint16_t *)g->out)[i * g->rows + r] = bf16_round(v);
    else ((float *)g->out)[i * g->rows + r] = v;
}

/* ---- AVX2 (+FMA, F16C) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline __m256i high_bits_avx2(uint32_t x) {
    __m256i t = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x),
                                    _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    t = _mm256_or_si256(t, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(t, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
}
#define TARGET_SUFFIX _avx2
#define DOT_U8S8(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define DOT_S16(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define HIGH_BITS(x) high_bits_avx2(x)
#include "_gemv.h"
#undef TARGET_SUFFIX
#undef DOT_U8S8
#undef DOT_S16
#undef HIGH_BITS
#pragma GCC pop_options

/* ---- AVX-VNNI (VEX-encoded dot products on 256-bit vectors) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define TARGET_SUFFIX _avxvnni
#define DOT_U8S8(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define DOT_S16(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#define HIGH_BITS(x) high_bits_avx2(x)
#include "_gemv.h"
#undef TARGET_SUFFIX
#undef DOT_U8S8
#undef DOT_S16
#undef HIGH_BITS
#pragma GCC pop_options

/* ---- AVX512-VNNI (with VL and BW: the same 256-bit kernels, EVEX-encoded, masks for the fifth bits) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define TARGET_SUFFIX _avx512vnni
#define DOT_U8S8(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define DOT_S16(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#define HIGH_BITS(x) _mm256_maskz_mov_epi8((__mmask32)(x), _mm256_set1_epi8(16))
#include "_gemv.h"
#undef TARGET_SUFFIX
#undef DOT_U8S8
#undef DOT_S16
#undef HIGH_BITS
#pragma GCC pop_options

enum { L_NONE, L_AVX2, L_AVXVNNI, L_AVX512VNNI };

static int best_level(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return L_NONE;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vnni"))
        return L_AVX512VNNI;
    if (__builtin_cpu_supports("avxvnni")) return L_AVXVNNI;
    return L_AVX2;
}

typedef void (*rows_fn)(const struct gemv *, int64_t, int64_t);
typedef void (*quant_fn)(const struct gemv *);

static void run_gemv(struct gemv *g, int level, int threads) {
    rows_fn rows = level == L_AVX512VNNI ? rows_avx512vnni : level == L_AVXVNNI ? rows_avxvnni : rows_avx2;
    quant_fn quant = level == L_AVX512VNNI ? quantize_avx512vnni : level == L_AVXVNNI ? quantize_avxvnni : quantize_avx2;
    quant(g);
    int64_t chunk = g->rows / (threads * 8);
    chunk = chunk < 8 ? 8 : (chunk + 7) / 8 * 8;
    int64_t chunks = (g->rows + chunk - 1) / chunk;
    if (threads <= 1 || chunks == 1) {
        rows(g, 0, g->rows);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t r1 = (c + 1) * chunk;
        rows(g, c * chunk, r1 < g->rows ? r1 : g->rows);
    }
}

/* ---- dequantization, scalar: the float32 values gguf computes (same products and sums, no FMA contraction) ---- */
static inline __attribute__((always_inline)) void dequant_block(int kind, const uint8_t *b, float *y) {
    switch (kind) {
    case K_Q8_0: { float d = half_at(b); for (int i = 0; i < 32; i++) y[i] = (float)(int8_t)b[2 + i] * d; break; }
    case K_Q4_0: {
        float d = half_at(b);
        for (int i = 0; i < 16; i++) { y[i] = d * (float)((b[2 + i] & 15) - 8); y[i + 16] = d * (float)((b[2 + i] >> 4) - 8); }
        break;
    }
    case K_Q4_1: {
        float d = half_at(b), m = half_at(b + 2);
        for (int i = 0; i < 16; i++) { y[i] = d * (float)(b[4 + i] & 15) + m; y[i + 16] = d * (float)(b[4 + i] >> 4) + m; }
        break;
    }
    case K_Q5_0: case K_Q5_1: {
        int o = kind == K_Q5_0 ? 2 : 4;
        float d = half_at(b), m = kind == K_Q5_1 ? half_at(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + o, 4);
        for (int i = 0; i < 16; i++) {
            int lo = (b[o + 4 + i] & 15) | (((qh >> i) & 1) << 4), hi = (b[o + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
            if (kind == K_Q5_0) { y[i] = d * (float)(lo - 16); y[i + 16] = d * (float)(hi - 16); }
            else { y[i] = d * (float)lo + m; y[i + 16] = d * (float)hi + m; }
        }
        break;
    }
    case K_Q4_K: case K_Q5_K: {
        float d = half_at(b), dmin = half_at(b + 2);
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 4; j++) {
            sc[j] = b[4 + j] & 63; mn[j] = b[8 + j] & 63;
            sc[j + 4] = (b[12 + j] & 0x0F) | ((b[4 + j] >> 6) << 4); mn[j + 4] = (b[12 + j] >> 4) | ((b[8 + j] >> 6) << 4);
        }
        const uint8_t *qs = b + (kind == K_Q4_K ? 16 : 48), *qh = b + 16;
        for (int j = 0; j < 8; j++) {
            float ds = d * (float)sc[j], dm = dmin * (float)mn[j];
            for (int l = 0; l < 32; l++) {
                int q = j & 1 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
                if (kind == K_Q5_K) q |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = ds * (float)q - dm;
            }
        }
        break;
    }
    default: { /* K_Q6_K */
        float d = half_at(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    uint8_t lb = b[64 * h + 32 * (k & 1) + l], hb = b[128 + 32 * h + l];
                    int q = ((k < 2 ? lb & 15 : lb >> 4) | (((hb >> (2 * k)) & 3) << 4)) - 32;
                    int at = 128 * h + 32 * k + l;
                    y[at] = (d * (float)sc[at / 16]) * (float)q;
                }
    }
    }
}

/* One row, compiled for AVX-512, AVX2 and the baseline (chosen when the module loads): the compiler vectorizes
   the block loops; the values are the same at every level (no FMA contraction: -ffp-contract=off). */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void dequant_row(int kind, const uint8_t *w, int64_t nb, void *out, int bf16) {
    float y[256];
    for (int64_t b = 0; b < nb; b++) {
        dequant_block(kind, w + b * BYTES[kind], y);
        int64_t at = b * BLOCK[kind];
        if (bf16) for (int i = 0; i < BLOCK[kind]; i++) ((uint16_t *)out)[at + i] = bf16_round(y[i]);
        else memcpy((float *)out + at, y, sizeof(float) * BLOCK[kind]);
    }
}

typedef void (*dequant_fn)(int, const uint8_t *, int64_t, void *, int);

static inline int vector_row(int kind) { return kind <= K_Q8_0 || kind == K_Q6_K; }

static void run_dequant(int kind, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t cols, void *out, int bf16,
                        int threads, int level) {
    int64_t nb = cols / BLOCK[kind], width = bf16 ? 2 : 4;
    /* the kinds with a vector row at this level; the others, or level 0: the scalar row */
    dequant_fn simd = !vector_row(kind) ? NULL : level == L_AVX512VNNI ? dequant_simd_avx512vnni
                    : level == L_AVXVNNI ? dequant_simd_avxvnni : level == L_AVX2 ? dequant_simd_avx2 : NULL;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * cols >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        if (simd) simd(kind, w + r * row_bytes, nb, (char *)out + r * cols * width, bf16);
        else dequant_row(kind, w + r * row_bytes, nb, (char *)out + r * cols * width, bf16);
    }
}

/* ---- Python ---- */
static PyObject *py_level(PyObject *self, PyObject *args) { return PyLong_FromLong(best_level()); }

static int check_kind(int kind) {
    if (kind < 0 || kind >= K_COUNT) {
        PyErr_SetString(PyExc_ValueError, "unknown block kind");
        return 0;
    }
    return 1;
}

/* gemv(kind, w, row_bytes, rows, cols, x, x_bf16, n, out, out_bf16, bias, threads, level) */
static PyObject *py_gemv(PyObject *self, PyObject *args) {
    struct gemv g;
    long long w, row_bytes, rows, cols, x, n, out, bias;
    int threads, level;
    if (!PyArg_ParseTuple(args, "iLLLLLiLLiLii", &g.kind, &w, &row_bytes, &rows, &cols, &x, &g.x_bf16, &n, &out,
                          &g.out_bf16, &bias, &threads, &level))
        return NULL;
    if (!check_kind(g.kind)) return NULL;
    if (level < L_AVX2 || level > best_level() || cols % BLOCK[g.kind] || (!is_float(g.kind) && cols % 32) || n < 1) {
        PyErr_SetString(PyExc_ValueError, "gemv: level not supported here, or bad shape");
        return NULL;
    }
    g.w = (const uint8_t *)(uintptr_t)w; g.row_bytes = row_bytes; g.rows = rows; g.cols = cols; g.n = n;
    g.x = (const void *)(uintptr_t)x; g.out = (void *)(uintptr_t)out; g.bias = (const float *)(uintptr_t)bias;
    int64_t group = is_k(g.kind) ? 256 : 32;
    char *scratch = malloc(is_float(g.kind) ? (size_t)(n * cols * 4)
                                            : (size_t)(n * cols + n * (cols / group) * 4 + n * (cols / 16) * 2 + n * (cols / 32) * 4 + 64));
    if (!scratch) return PyErr_NoMemory();
    g.xf = (float *)scratch;
    g.d = (float *)scratch;
    g.s32 = (int32_t *)(g.d + n * (cols / group));
    g.s16 = (int16_t *)(g.s32 + n * (cols / 32));
    g.q = (int8_t *)(g.s16 + n * (cols / 16));
    Py_BEGIN_ALLOW_THREADS
    run_gemv(&g, level, threads);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}

/* dequantize(kind, w, row_bytes, rows, cols, out, out_bf16, threads, level): level 0, the scalar rows */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    int kind, bf16, threads, level;
    long long w, row_bytes, rows, cols, out;
    if (!PyArg_ParseTuple(args, "iLLLLLiii", &kind, &w, &row_bytes, &rows, &cols, &out, &bf16, &threads, &level))
        return NULL;
    if (!check_kind(kind)) return NULL;
    if (is_float(kind) || cols % BLOCK[kind] || level < L_NONE || level > best_level()) {
        PyErr_SetString(PyExc_ValueError, "dequantize: not a quantized kind, cols not a whole number of blocks, or a level"
                                          " not supported here");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run_dequant(kind, (const uint8_t *)(uintptr_t)w, row_bytes, rows, cols, (void *)(uintptr_t)out, bf16, threads, level);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"level", py_level, METH_NOARGS, "The best kernel level this CPU runs: 0 none, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI."},
    {"gemv", py_gemv, METH_VARARGS, "Few-row product with 8-bit activations over GGUF blocks."},
    {"dequantize", py_dequantize, METH_VARARGS, "GGUF blocks -> float32 or bfloat16 rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }

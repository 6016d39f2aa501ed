/* Native kernels for GGUF blocks: few-row products with 8-bit activations and integer dot products (AVX512-VNNI,
   AVX-VNNI, or AVX2), the same with float32 products for float weights (F32, F16, BF16), and dequantization of the
   quantized kinds to float32 or bfloat16 for prefill GEMMs (vector rows at each level for the per-32 kinds and Q6_K,
   scalar rows the compiler vectorizes for Q4_K and Q5_K; the same bits either way), and one query row's attention in
   bfloat16 or float16 for a decoding step.

   Built without -march flags: every SIMD function is compiled for its own CPU level (`#pragma GCC target`) and
   chosen at run time (`level`). Rows of the weight are spread over OpenMP threads; imported after torch, the
   module shares torch's libgomp (same soname), so its threads are torch's. Python passes data pointers of
   contiguous CPU tensors it owns and checked (kernels/native.py); the GIL is released while computing. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
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

/* ---- one query row's attention in bfloat16 or float16 (a decoding step): the roundings of transformers' eager
   attention (scores rounded to the dtype, scaled and rounded again; softmax in float32; probabilities rounded to the
   dtype; their products with the values summed in float32 and rounded), each key and value read once. The keys are
   cut into chunks of ATT_CHUNK whatever the thread count, and the chunks' sums added in order: the same bits on any
   number of threads. ---- */
#define ATT_CHUNK 256
#define ATT_MAX_D 256
#ifndef ATT_SUB
#define ATT_SUB 64  /* keys whose values are turned to float32 at a time (d x 256 bytes: within the L1 cache) */
#endif

struct attend {
    const uint16_t *q, *k, *v;  /* q [heads, d]; k, v [kv_heads, n, d] with the strides below (elements) */
    uint16_t *out;              /* [heads, d] */
    int64_t heads, kv_heads, n, d, k_head, k_tok, v_head, v_tok, chunks;
    float scale;
    int f16;
    float *qf, *s, *part;       /* scratch: q as float32 [heads, d]; scores then probabilities [heads, n]; [heads, chunks, d] */
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline float att_round(float f, int f16) {
    if (f16) return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
    uint32_t u = (uint32_t)bf16_round(f) << 16;
    memcpy(&f, &u, 4);
    return f;
}

/* eight bfloat16 or float16 values -> float32 */
static inline __m256 att_widen8(__m128i h, int f16) {
    return f16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 att_load8(const uint16_t *p, int f16) { return att_widen8(_mm_loadu_si128((const __m128i *)p), f16); }

/* eight float32 values rounded to the dtype (nearest even, NaN kept quiet: bf16_8's bits), as float32 */
static inline __m256 att_round8(__m256 x, int f16) {
    return att_widen8(f16 ? _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT) : bf16_8_avx2(x), f16);
}

/* [a0..a7] -> the eight lanes' sums, in one vector (a fixed order of additions) */
static inline __m256 att_sum8(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* e^x for x <= 0 (Cephes' polynomial on x - n ln2, n = round(x / ln2)); below -87: 0; NaN stays NaN (a score of
   NaN or infinity then makes its row NaN, as torch's softmax does) */
static inline __m256 att_exp(__m256 x) {
    __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_or_ps(nan, _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e))));
}

/* scores of one key/value head's query heads against keys [t0, t1): s = round(round(q . k) * scale) */
static void att_scores(const struct attend *a, int64_t g, int64_t t0, int64_t t1) {
    int64_t d = a->d, rep = a->heads / a->kv_heads;
    float kf[8 * ATT_MAX_D];  /* 8 keys as float32 (on the stack: measured faster than a slice of the call's allocation) */
    for (int64_t t = t0; t < t1; t += 8) {
        int64_t nt = t1 - t < 8 ? t1 - t : 8;
        for (int64_t j = 0; j < nt; j++)
            for (int64_t c = 0; c < d; c += 8) _mm256_storeu_ps(kf + j * d + c, att_load8(a->k + g * a->k_head + (t + j) * a->k_tok + c, a->f16));
        if (nt < 8) memset(kf + nt * d, 0, sizeof(float) * (size_t)((8 - nt) * d));
        for (int64_t r = 0; r < rep; r++) {
            int64_t h = g * rep + r;
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 8) {
                __m256 qv = _mm256_loadu_ps(a->qf + h * d + c);
                for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(kf + j * d + c), qv, acc[j]);
            }
            __m256 s = att_round8(_mm256_mul_ps(att_round8(att_sum8(acc), a->f16), _mm256_set1_ps(a->scale)), a->f16);
            if (nt == 8) _mm256_storeu_ps(a->s + h * a->n + t, s);
            else {
                float dots[8];
                _mm256_storeu_ps(dots, s);
                memcpy(a->s + h * a->n + t, dots, sizeof(float) * nt);
            }
        }
    }
}

/* one head's scores -> probabilities, rounded to the dtype: softmax in float32 */
static void att_softmax(const struct attend *a, int64_t h) {
    float *s = a->s + h * a->n;
    int64_t n = a->n, t = 0;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m[8], m1 = -INFINITY;
    _mm256_storeu_ps(m, mv);
    for (int j = 0; j < 8; j++) m1 = m[j] > m1 ? m[j] : m1;
    for (; t < n; t++) m1 = s[t] > m1 ? s[t] : m1;
    __m256 sv = _mm256_setzero_ps(), m8 = _mm256_set1_ps(m1);
    float tail = 0.0f;
    for (t = 0; t + 8 <= n; t += 8) {
        __m256 e = att_exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
        _mm256_storeu_ps(s + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    for (; t < n; t++) {
        float e[8];
        _mm256_storeu_ps(e, att_exp(_mm256_set1_ps(s[t] - m1)));
        s[t] = e[0];
        tail += e[0];
    }
    float parts[8], sum = 0.0f;
    _mm256_storeu_ps(parts, sv);
    for (int j = 0; j < 8; j++) sum += parts[j];
    sum += tail;
    __m256 sum8 = _mm256_set1_ps(sum);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, att_round8(_mm256_div_ps(_mm256_loadu_ps(s + t), sum8), a->f16));
    for (; t < n; t++) s[t] = att_round(s[t] / sum, a->f16);
}

/* nr query heads' probabilities p[i] over keys [0, nt) times those keys' values, one 8-column block of vf (the values
   as float32, [nt][8]), added to out[i] (8 floats each): nr accumulators in registers, each value loaded once */
static inline __attribute__((always_inline)) void att_tile(const float *const *p, const float *vf, int64_t nt, int nr,
                                                           float *const *out) {
    __m256 acc[8];
    for (int i = 0; i < nr; i++) acc[i] = _mm256_loadu_ps(out[i]);
    for (int64_t t = 0; t < nt; t++) {
        __m256 v = _mm256_loadu_ps(vf + t * 8);
        for (int i = 0; i < nr; i++) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p[i] + t), v, acc[i]);
    }
    for (int i = 0; i < nr; i++) _mm256_storeu_ps(out[i], acc[i]);
}

/* one key/value head's query heads: probabilities times values over keys [t0, t1) -> part [heads, chunks, d] */
static void att_values(const struct attend *a, int64_t g, int64_t chunk, int64_t t0, int64_t t1) {
    int64_t d = a->d, rep = a->heads / a->kv_heads;
    float vf[ATT_MAX_D * ATT_SUB];  /* [d / 8][ATT_SUB][8]: ATT_SUB keys' values as float32 */
    for (int64_t r = 0; r < rep; r++) memset(a->part + ((g * rep + r) * a->chunks + chunk) * d, 0, sizeof(float) * (size_t)d);
    for (int64_t s0 = t0; s0 < t1; s0 += ATT_SUB) {
        int64_t nt = t1 - s0 < ATT_SUB ? t1 - s0 : ATT_SUB;
        for (int64_t t = 0; t < nt; t++)
            for (int64_t c = 0; c < d; c += 8)
                _mm256_storeu_ps(vf + (c / 8) * ATT_SUB * 8 + t * 8, att_load8(a->v + g * a->v_head + (s0 + t) * a->v_tok + c, a->f16));
        for (int64_t r0 = 0; r0 < rep; r0 += 8) {
            int nr = rep - r0 < 8 ? (int)(rep - r0) : 8;
            const float *p[8];
            float *out[8];
            for (int64_t c = 0; c < d; c += 8) {
                for (int i = 0; i < nr; i++) {
                    int64_t h = g * rep + r0 + i;
                    p[i] = a->s + h * a->n + s0;
                    out[i] = a->part + (h * a->chunks + chunk) * d + c;
                }
                const float *vc = vf + (c / 8) * ATT_SUB * 8;
                switch (nr) {  /* a constant count each: the accumulators stay in registers */
                case 1: att_tile(p, vc, nt, 1, out); break;
                case 2: att_tile(p, vc, nt, 2, out); break;
                case 3: att_tile(p, vc, nt, 3, out); break;
                case 4: att_tile(p, vc, nt, 4, out); break;
                case 5: att_tile(p, vc, nt, 5, out); break;
                case 6: att_tile(p, vc, nt, 6, out); break;
                case 7: att_tile(p, vc, nt, 7, out); break;
                default: att_tile(p, vc, nt, 8, out);
                }
            }
        }
    }
}

static void run_attend(struct attend *a, int threads) {
    int64_t units = a->kv_heads * a->chunks;
    for (int64_t i = 0; i < a->heads * a->d; i += 8) _mm256_storeu_ps(a->qf + i, att_load8(a->q + i, a->f16));
#pragma omp parallel num_threads(threads) if (threads > 1 && a->n * a->heads >= 4096)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            int64_t g = u / a->chunks, c = u % a->chunks, t1 = (c + 1) * ATT_CHUNK;
            att_scores(a, g, c * ATT_CHUNK, t1 < a->n ? t1 : a->n);
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < a->heads; h++) att_softmax(a, h);
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            int64_t g = u / a->chunks, c = u % a->chunks, t1 = (c + 1) * ATT_CHUNK;
            att_values(a, g, c, c * ATT_CHUNK, t1 < a->n ? t1 : a->n);
        }
#pragma omp for schedule(static)
        for (int64_t h = 0; h < a->heads; h++)
            for (int64_t c = 0; c < a->d; c++) {
                float y = 0.0f;
                for (int64_t k = 0; k < a->chunks; k++) y += a->part[(h * a->chunks + k) * a->d + c];
                a->out[h * a->d + c] = a->f16 ? _cvtss_sh(y, _MM_FROUND_TO_NEAREST_INT) : bf16_round(y);
            }
    }
}
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

/* attend(q, k, v, out, f16, heads, kv_heads, n, d, k_head, k_tok, v_head, v_tok, scale, threads) */
static PyObject *py_attend(PyObject *self, PyObject *args) {
    struct attend a;
    long long q, k, v, out, heads, kv_heads, n, d, k_head, k_tok, v_head, v_tok;
    int threads;
    if (!PyArg_ParseTuple(args, "LLLLiLLLLLLLLfi", &q, &k, &v, &out, &a.f16, &heads, &kv_heads, &n, &d, &k_head, &k_tok,
                          &v_head, &v_tok, &a.scale, &threads))
        return NULL;
    if (best_level() < L_AVX2 || kv_heads < 1 || heads % kv_heads || n < 1 || d < 8 || d % 8 || d > ATT_MAX_D) {
        PyErr_SetString(PyExc_ValueError, "attend: no AVX2 here, or bad shape");
        return NULL;
    }
    a.q = (const uint16_t *)(uintptr_t)q; a.k = (const uint16_t *)(uintptr_t)k; a.v = (const uint16_t *)(uintptr_t)v;
    a.out = (uint16_t *)(uintptr_t)out;
    a.heads = heads; a.kv_heads = kv_heads; a.n = n; a.d = d; a.k_head = k_head; a.k_tok = k_tok; a.v_head = v_head;
    a.v_tok = v_tok; a.chunks = (n + ATT_CHUNK - 1) / ATT_CHUNK;
    float *scratch = malloc(sizeof(float) * (size_t)(heads * d + heads * n + heads * a.chunks * d));
    if (!scratch) return PyErr_NoMemory();
    a.qf = scratch; a.s = scratch + heads * d; a.part = a.s + heads * n;
    Py_BEGIN_ALLOW_THREADS
    run_attend(&a, threads);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"level", py_level, METH_NOARGS, "The best kernel level this CPU runs: 0 none, 1 AVX2, 2 AVX-VNNI, 3 AVX512-VNNI."},
    {"gemv", py_gemv, METH_VARARGS, "Few-row product with 8-bit activations over GGUF blocks."},
    {"dequantize", py_dequantize, METH_VARARGS, "GGUF blocks -> float32 or bfloat16 rows."},
    {"attend", py_attend, METH_VARARGS, "One query row's attention in bfloat16 or float16."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }

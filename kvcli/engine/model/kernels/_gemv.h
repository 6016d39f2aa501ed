/* One CPU level's kernels, included by _native.c once per level with TARGET_SUFFIX (name suffix), DOT_U8S8
   (acc += 4-byte dot products of unsigned x signed bytes), DOT_S16 (acc += pairs of int16 products) and
   HIGH_BITS (32 bits -> 32 bytes of 0x10 or 0) defined, inside a `#pragma GCC target` region. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, TARGET_SUFFIX)

static inline float FN(hsum_ps)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float FN(f16)(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes -> 32 codes: low nibbles (weights 0-15) in the low lane, high nibbles (16-31) in the high lane. */
static inline __m256i FN(nibbles)(const uint8_t *p) {
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

/* Activations of one row, float32 or bfloat16 [cols] -> int8 codes, one float scale per `group` weights (32 or
   256: amax / 127, codes rounded to nearest), and the codes' sums per 16 (int16) or per 32 (int32). */
static void FN(quantize_row)(const void *xv, int bf16, int64_t cols, int group, int8_t *q, float *d, int16_t *s16,
                             int32_t *s32) {
    float buf[256];
    for (int64_t g = 0; g < cols / group; g++) {
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < group; i += 8) {
            __m256 v;
            if (bf16) {
                __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)xv + g * group + i));
                v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                v = _mm256_loadu_ps((const float *)xv + g * group + i);
            }
            _mm256_storeu_ps(buf + i, v);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        float mx = _mm_cvtss_f32(m);
        float scale = mx / 127.0f;
        float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
        d[g] = scale;
        __m256 iv = _mm256_set1_ps(inv);
        for (int i = 0; i < group; i += 16) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(buf + i), iv));
            __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(buf + i + 8), iv));
            __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  /* 16 int16 in order */
            __m128i c = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            _mm_storeu_si128((__m128i *)(q + g * group + i), c);
            __m256i ws = _mm256_madd_epi16(w, _mm256_set1_epi16(1));
            __m128i t = _mm_add_epi32(_mm256_castsi256_si128(ws), _mm256_extracti128_si256(ws, 1));
            t = _mm_hadd_epi32(t, t);
            t = _mm_hadd_epi32(t, t);
            int sum = _mm_cvtsi128_si32(t);
            if (s16) s16[(g * group + i) / 16] = (int16_t)sum;
            if (s32) {
                if (i % 32 == 0) s32[(g * group + i) / 32] = sum;
                else s32[(g * group + i) / 32] += sum;
            }
        }
    }
}

#define INLINE static inline __attribute__((always_inline))

/* Per-32 formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), R weight rows (w: the first, `stride` bytes between rows) against
   X rows of activations quantized per 32 (codes q, scales d, sums s; row j at q + j * cols, d + j * nb, s + j * nb):
   res[r * X + j] = the dot product of weight row r and activation row j. Each weight block is unpacked once for
   the X rows; every (r, j) sums in the same order whatever R and X, so a row's result does not depend on its
   neighbours. Offsets of unsigned codes (-8, -16) are taken off as integers (times the activations' sums). */
INLINE void FN(dot_q32)(const int kind, const int R, const int X, const uint8_t *w, int64_t stride, int64_t nb,
                        const int8_t *q, int64_t cols, const float *d, const int32_t *s, float *res) {
    __m256 acc[4][4];
    float corr[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < X; j++) { acc[r][j] = _mm256_setzero_ps(); corr[r][j] = 0; }
    const int size = kind == K_Q8_0 ? 34 : kind == K_Q4_0 ? 18 : kind == K_Q4_1 ? 20 : kind == K_Q5_0 ? 22 : 24;
    for (int64_t b = 0; b < nb; b++) {
        __m256i x[4];
        float dx[4];
        int sb[4];
        for (int j = 0; j < X; j++) {
            x[j] = _mm256_loadu_si256((const __m256i *)(q + j * cols + 32 * b));
            dx[j] = d[j * nb + b];
            sb[j] = s[j * nb + b];
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = w + r * stride + size * b;
            if (R > 1 && (b & 1) == 0) _mm_prefetch((const char *)blk + PREFETCH_ROWS * stride, _MM_HINT_T0);
            const float dw = FN(f16)(blk);
            __m256i u, v = _mm256_setzero_si256();
            if (kind == K_Q8_0) {  /* signed codes: |w| times x with w's signs */
                v = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u = _mm256_sign_epi8(v, v);
            } else if (kind == K_Q4_0 || kind == K_Q4_1) {
                u = FN(nibbles)(blk + size - 16);
            } else {
                uint32_t qh;
                memcpy(&qh, blk + size - 20, 4);
                u = _mm256_or_si256(FN(nibbles)(blk + size - 16), HIGH_BITS(qh));
            }
            for (int j = 0; j < X; j++) {
                __m256i p = DOT_U8S8(_mm256_setzero_si256(), u, kind == K_Q8_0 ? _mm256_sign_epi8(x[j], v) : x[j]);
                if (kind == K_Q4_0 || kind == K_Q5_0)
                    p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128((kind == K_Q4_0 ? 8 : 16) * sb[j])));
                if (kind == K_Q4_1 || kind == K_Q5_1) corr[r][j] += FN(f16)(blk + 2) * dx[j] * (float)sb[j];
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dx[j]), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < X; j++) res[r * X + j] = FN(hsum_ps)(acc[r][j]) + corr[r][j];
}

/* Q4_K and Q5_K's 6-bit scales (bytes 0-7) and mins (8-15) of one block, as 16 int16. */
INLINE __m256i FN(k_scales_mins)(const uint8_t *s) {
    uint32_t u[4];
    memcpy(u, s, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    const uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
}

/* vpshufb masks: for sub-block j, int16 lane j of each 128-bit lane broadcast over that lane. */
static const uint8_t FN(spread)[8][32] __attribute__((aligned(32))) = {
#define S2(j) 2 * (j), 2 * (j) + 1
#define S16(j) S2(j), S2(j), S2(j), S2(j), S2(j), S2(j), S2(j), S2(j)
    {S16(0), S16(0)}, {S16(1), S16(1)}, {S16(2), S16(2)}, {S16(3), S16(3)},
    {S16(4), S16(4)}, {S16(5), S16(5)}, {S16(6), S16(6)}, {S16(7), S16(7)},
};
/* Q6_K: sub-block k (0-7) covers scales 2k (low lane) and 2k+1 (high lane) of a vector holding 8 scales per lane. */
static const uint8_t FN(spread6)[4][32] __attribute__((aligned(32))) = {
    {S16(0), S16(1)}, {S16(2), S16(3)}, {S16(4), S16(5)}, {S16(6), S16(7)},
#undef S16
#undef S2
};

#define SPREAD(v, j) _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i *)FN(spread)[j]))
#define SPREAD6(v, j) _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i *)FN(spread6)[j]))

/* Q4_K, Q5_K, Q6_K, R weight rows against X rows of activations quantized per 256 (codes q, scales d, sums per 16
   s16; row j at q + j * cols, d + j * nb, s16 + j * 16 * nb), as dot_q32 (res[r * X + j], the same order for every
   R and X). */
INLINE void FN(dot_k)(const int kind, const int R, const int X, const uint8_t *w, int64_t stride, int64_t nb,
                      const int8_t *q, int64_t cols, const float *d, const int16_t *s16, float *res) {
    __m256 acc[4][4];
    __m128 accm[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < X; j++) { acc[r][j] = _mm256_setzero_ps(); accm[r][j] = _mm_setzero_ps(); }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int size = kind == K_Q4_K ? 144 : kind == K_Q5_K ? 176 : 210;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *x[4];
        __m256i bs[4];
        float dx[4];
        for (int j = 0; j < X; j++) {
            x[j] = q + j * cols + 256 * b;
            bs[j] = _mm256_loadu_si256((const __m256i *)(s16 + 16 * (j * nb + b)));
            dx[j] = d[j * nb + b];
        }
        if (kind == K_Q6_K) {
            for (int r = 0; r < R; r++) {
                const uint8_t *blk = w + r * stride + size * b;
                for (int l = 0; l < size; l += 64) _mm_prefetch((const char *)blk + PREFETCH_ROWS * stride + l, _MM_HINT_T0);
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
                const __m256i sv[2] = {_mm256_permute2x128_si256(sc, sc, 0x00), _mm256_permute2x128_si256(sc, sc, 0x11)};
                __m256i p[4];
                for (int j = 0; j < X; j++)  /* the codes' offset: -32 * scale * sums */
                    p[j] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc, bs[j]), 5));
                for (int h = 0; h < 2; h++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                    __m256i c[4];
                    c[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), _mm256_set1_epi8(0x30)));
                    c[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), _mm256_set1_epi8(0x30)));
                    c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
                    c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), _mm256_set1_epi8(0x30)));
                    for (int k = 0; k < 4; k++) {
                        const __m256i scale = SPREAD6(sv[h], k);
                        for (int j = 0; j < X; j++) {
                            const __m256i t = _mm256_maddubs_epi16(c[k], _mm256_loadu_si256((const __m256i *)(x[j] + 128 * h + 32 * k)));
                            p[j] = DOT_S16(p[j], t, scale);
                        }
                    }
                }
                const float dw = FN(f16)(blk + 208);
                for (int j = 0; j < X; j++)
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[j]), _mm256_set1_ps(dw * dx[j]), acc[r][j]);
            }
        } else {
            /* sums per 32 (sub-block i: sums 2i and 2i+1), in int16 lanes 0-7 */
            __m128i bs32[4];
            for (int j = 0; j < X; j++)
                bs32[j] = _mm_hadd_epi16(_mm256_castsi256_si128(bs[j]), _mm256_extracti128_si256(bs[j], 1));
            for (int r = 0; r < R; r++) {
                const uint8_t *blk = w + r * stride + size * b;
                for (int l = 0; l < size; l += 64) _mm_prefetch((const char *)blk + PREFETCH_ROWS * stride + l, _MM_HINT_T0);
                const uint8_t *qs = blk + (kind == K_Q4_K ? 16 : 48);
                const __m256i sm = FN(k_scales_mins)(blk + 4);
                const __m256i sc = _mm256_permute2x128_si256(sm, sm, 0x00);
                const __m128i mins = _mm256_extracti128_si256(sm, 1);
                const float dmin = FN(f16)(blk + 2), dw = FN(f16)(blk);
                __m256i p[4];
                for (int j = 0; j < X; j++) {
                    accm[r][j] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bs32[j])), _mm_set1_ps(dmin * dx[j]), accm[r][j]);
                    p[j] = _mm256_setzero_si256();
                }
                const __m256i qh = kind == K_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
                for (int i = 0; i < 4; i++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    if (kind == K_Q5_K) {  /* bit 2i of qh -> 16 in lo, bit 2i+1 -> 16 in hi */
                        const __m256i h = _mm256_srli_epi16(qh, 2 * i);
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), _mm256_set1_epi8(16)));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), _mm256_set1_epi8(16)));
                    }
                    const __m256i s0 = SPREAD(sc, 2 * i), s1 = SPREAD(sc, 2 * i + 1);
                    for (int j = 0; j < X; j++) {
                        const __m256i t0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x[j] + 64 * i)));
                        const __m256i t1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x[j] + 64 * i + 32)));
                        p[j] = DOT_S16(p[j], t0, s0);
                        p[j] = DOT_S16(p[j], t1, s1);
                    }
                }
                for (int j = 0; j < X; j++)
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[j]), _mm256_set1_ps(dw * dx[j]), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < X; j++) {
            __m128 m = accm[r][j];
            m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            res[r * X + j] = FN(hsum_ps)(acc[r][j]) - _mm_cvtss_f32(m);
        }
}

#undef SPREAD
#undef SPREAD6

/* 8 float weights (F32, F16 or BF16) at p -> float32. */
INLINE __m256 FN(float8)(const int kind, const uint8_t *p) {
    if (kind == K_F32) return _mm256_loadu_ps((const float *)p);
    if (kind == K_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Float weights, R rows against X rows of float32 activations (row j at x + j * cols): res[r * X + j], float32
   products summed 8 lanes at a time in column order, then across the lanes (the same for every R and X). */
INLINE void FN(dot_f)(const int kind, const int R, const int X, const uint8_t *w, int64_t stride, int64_t cols,
                      const float *x, float *res) {
    __m256 acc[4][4];
    const int width = kind == K_F32 ? 4 : 2;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < X; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < cols; c += 8) {
        __m256 xv[4];
        for (int j = 0; j < X; j++) xv[j] = _mm256_loadu_ps(x + j * cols + c);
        for (int r = 0; r < R; r++) {
            const uint8_t *at = w + r * stride + c * width;
            if (R > 1 && (c * width) % 64 == 0) _mm_prefetch((const char *)at + PREFETCH_ROWS * stride, _MM_HINT_T0);
            const __m256 wv = FN(float8)(kind, at);
            for (int j = 0; j < X; j++) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < X; j++) res[r * X + j] = FN(hsum_ps)(acc[r][j]);
}

/* R weight rows from row r against X activation rows from row i: out[i + j, r + k] for k < R, j < X. */
#define DOT_TILE(KIND, R, X)                                                                                         \
    do {                                                                                                             \
        float v[(R) * (X)];                                                                                          \
        if (is_float(KIND)) FN(dot_f)(KIND, R, X, g->w + r * g->row_bytes, g->row_bytes, g->cols,                   \
                                      g->xf + i * g->cols, v);                                                       \
        else if (is_k(KIND)) FN(dot_k)(KIND, R, X, g->w + r * g->row_bytes, g->row_bytes, nb, g->q + i * g->cols, g->cols,\
                                  g->d + i * nb, g->s16 + i * (g->cols / 16), v);                                    \
        else FN(dot_q32)(KIND, R, X, g->w + r * g->row_bytes, g->row_bytes, nb, g->q + i * g->cols, g->cols,          \
                         g->d + i * nb, g->s32 + i * (g->cols / 32), v);                                             \
        for (int k = 0; k < (R); k++) for (int j = 0; j < (X); j++) put(g, i + j, r + k, v[k * (X) + j]);              \
    } while (0)

/* Four weight rows at a time (one activation load serves them), each against four activation rows at a time (one
   unpacking of the weights serves those); the rest one by one. */
#define ROWS_OF(KIND)                                                                                               \
    for (; r + 4 <= r1; r += 4) {                                                                                   \
        int64_t i = 0;                                                                                              \
        for (; i + 4 <= g->n; i += 4) DOT_TILE(KIND, 4, 4);                                                         \
        for (; i < g->n; i++) DOT_TILE(KIND, 4, 1);                                                                 \
    }                                                                                                               \
    for (; r < r1; r++) {                                                                                           \
        int64_t i = 0;                                                                                              \
        for (; i + 4 <= g->n; i += 4) DOT_TILE(KIND, 1, 4);                                                         \
        for (; i < g->n; i++) DOT_TILE(KIND, 1, 1);                                                                 \
    }

/* out[i, r] = dot(x row i, w row r) (+ bias[r]) for rows [r0, r1) of w and the n rows of x (already quantized). */
static void FN(rows)(const struct gemv *g, int64_t r0, int64_t r1) {
    const int64_t nb = g->cols / BLOCK[g->kind];
    int64_t r = r0;
    switch (g->kind) {
    case K_F32: ROWS_OF(K_F32) break;
    case K_F16: ROWS_OF(K_F16) break;
    case K_BF16: ROWS_OF(K_BF16) break;
    case K_Q4_0: ROWS_OF(K_Q4_0) break;
    case K_Q4_1: ROWS_OF(K_Q4_1) break;
    case K_Q5_0: ROWS_OF(K_Q5_0) break;
    case K_Q5_1: ROWS_OF(K_Q5_1) break;
    case K_Q8_0: ROWS_OF(K_Q8_0) break;
    case K_Q4_K: ROWS_OF(K_Q4_K) break;
    case K_Q5_K: ROWS_OF(K_Q5_K) break;
    default: ROWS_OF(K_Q6_K) break;
    }
}

#undef ROWS_OF
#undef DOT_TILE
#undef INLINE

/* 8 float32 -> 8 bfloat16, rounded to nearest even, NaNs kept quiet: bf16_round's bits. */
static inline __m128i FN(bf16_8)(__m256 y) {
    __m256i u = _mm256_castps_si256(y);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void FN(put8)(void *out, int64_t at, __m256 y, int bf16) {
    if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)out + at), FN(bf16_8)(y));
    else _mm256_storeu_ps((float *)out + at, y);
}

/* 32 byte codes (signed for Q8_0 and Q6_K), less `off`, as 4 x 8 float32 times d0 (the first 16) and d1 (the
   last 16), plus m: put at `at` on. One rounding per product and per sum, as dequant_block's scalar code (no FMA),
   so the values are gguf's bit for bit. */
static inline void FN(put32)(void *out, int64_t at, __m256i u, int is_signed, int off, float d0, float d1, int add_m,
                             float m, int bf16) {
    const __m256 mv = _mm256_set1_ps(m);
    const __m256i ov = _mm256_set1_epi32(off);
    for (int c = 0; c < 4; c++) {
        __m128i part = c < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1);
        if (c & 1) part = _mm_srli_si128(part, 8);
        __m256i q = is_signed ? _mm256_cvtepi8_epi32(part) : _mm256_sub_epi32(_mm256_cvtepu8_epi32(part), ov);
        __m256 y = _mm256_mul_ps(_mm256_set1_ps(c < 2 ? d0 : d1), _mm256_cvtepi32_ps(q));
        if (add_m) y = _mm256_add_ps(y, mv);
        FN(put8)(out, at + 8 * c, y, bf16);
    }
}

/* One row of nb blocks of a kind vector_row() takes (the per-32 kinds, Q6_K) -> float32 or bfloat16 values. */
static void FN(dequant_simd)(int kind, const uint8_t *w, int64_t nb, void *out, int bf16) {
    if (kind == K_Q6_K) {
        const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03), bias = _mm256_set1_epi8(32);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + 210 * b;
            const float d = half_at(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);  /* one scale per 16 weights */
            for (int h = 0; h < 2; h++) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                for (int k = 0; k < 4; k++) {
                    const __m256i lb = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (k & 1)));
                    __m256i lo = _mm256_and_si256(k < 2 ? lb : _mm256_srli_epi16(lb, 4), low4);
                    __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * k), low2), 4);
                    __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), bias);  /* -32..31 */
                    const int s = 8 * h + 2 * k;
                    FN(put32)(out, 256 * b + 128 * h + 32 * k, q, 1, 0, d * (float)sc[s], d * (float)sc[s + 1], 0, 0.0f, bf16);
                }
            }
        }
        return;
    }
    const int size = BYTES[kind];
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + size * b;
        const float d = half_at(blk);
        uint32_t qh;
        switch (kind) {
        case K_Q8_0: FN(put32)(out, 32 * b, _mm256_loadu_si256((const __m256i *)(blk + 2)), 1, 0, d, d, 0, 0.0f, bf16); break;
        case K_Q4_0: FN(put32)(out, 32 * b, FN(nibbles)(blk + 2), 0, 8, d, d, 0, 0.0f, bf16); break;
        case K_Q4_1: FN(put32)(out, 32 * b, FN(nibbles)(blk + 4), 0, 0, d, d, 1, half_at(blk + 2), bf16); break;
        case K_Q5_0:
            memcpy(&qh, blk + 2, 4);
            FN(put32)(out, 32 * b, _mm256_or_si256(FN(nibbles)(blk + 6), HIGH_BITS(qh)), 0, 16, d, d, 0, 0.0f, bf16);
            break;
        default:  /* K_Q5_1 */
            memcpy(&qh, blk + 4, 4);
            FN(put32)(out, 32 * b, _mm256_or_si256(FN(nibbles)(blk + 8), HIGH_BITS(qh)), 0, 0, d, d, 1, half_at(blk + 2), bf16);
        }
    }
}

static void FN(quantize)(const struct gemv *g) {
    if (is_float(g->kind)) {  /* float weights: the activations as float32, not quantized */
        for (int64_t i = 0; i < g->n * g->cols; i += 8) {
            __m256 v;
            if (g->x_bf16) v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                   _mm_loadu_si128((const __m128i *)((const uint16_t *)g->x + i))), 16));
            else v = _mm256_loadu_ps((const float *)g->x + i);
            _mm256_storeu_ps(g->xf + i, v);
        }
        return;
    }
    int kq = is_k(g->kind);
    int64_t group = kq ? 256 : 32;
    for (int64_t i = 0; i < g->n; i++) {
        const void *x = (const char *)g->x + i * g->cols * (g->x_bf16 ? 2 : 4);
        FN(quantize_row)(x, g->x_bf16, g->cols, (int)group, g->q + i * g->cols, g->d + i * (g->cols / group),
                         kq ? g->s16 + i * (g->cols / 16) : NULL, kq ? NULL : g->s32 + i * (g->cols / 32));
    }
}

#undef FN
#undef CAT
#undef CAT_

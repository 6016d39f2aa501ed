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

/* Per-32 formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against activations quantized per 32 (q, d, sums s). */
static float FN(dot_q32)(int kind, const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *s) {
    __m256 acc = _mm256_setzero_ps();
    float corr = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(q + 32 * b));
        __m256i p = _mm256_setzero_si256();
        float dw;
        switch (kind) {
        case K_Q8_0: {
            const uint8_t *blk = w + 34 * b;
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 2));
            p = DOT_U8S8(p, _mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
            dw = FN(f16)(blk);
            break;
        }
        case K_Q4_0: {
            const uint8_t *blk = w + 18 * b;
            p = DOT_U8S8(p, FN(nibbles)(blk + 2), x);
            dw = FN(f16)(blk);
            corr -= 8.0f * dw * d[b] * (float)s[b];
            break;
        }
        case K_Q4_1: {
            const uint8_t *blk = w + 20 * b;
            p = DOT_U8S8(p, FN(nibbles)(blk + 4), x);
            dw = FN(f16)(blk);
            corr += FN(f16)(blk + 2) * d[b] * (float)s[b];
            break;
        }
        case K_Q5_0: {
            const uint8_t *blk = w + 22 * b;
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            p = DOT_U8S8(p, _mm256_or_si256(FN(nibbles)(blk + 6), HIGH_BITS(qh)), x);
            dw = FN(f16)(blk);
            corr -= 16.0f * dw * d[b] * (float)s[b];
            break;
        }
        default: { /* K_Q5_1 */
            const uint8_t *blk = w + 24 * b;
            uint32_t qh;
            memcpy(&qh, blk + 4, 4);
            p = DOT_U8S8(p, _mm256_or_si256(FN(nibbles)(blk + 8), HIGH_BITS(qh)), x);
            dw = FN(f16)(blk);
            corr += FN(f16)(blk + 2) * d[b] * (float)s[b];
            break;
        }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * d[b]), acc);
    }
    return FN(hsum_ps)(acc) + corr;
}

/* Q4_K and Q5_K's 6-bit scales and mins of one block. */
static inline void FN(k_scales)(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q4_K, Q5_K, Q6_K against activations quantized per 256 (q, d) with sums per 16 (s16). */
static float FN(dot_k)(int kind, const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int16_t *s16) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *x = q + 256 * b;
        const int16_t *bs = s16 + 16 * b;
        __m256i p = _mm256_setzero_si256();
        float scale, minus = 0.0f;
        if (kind == K_Q6_K) {
            const uint8_t *blk = w + 210 * b;
            const int8_t *sc = (const int8_t *)(blk + 192);
            int corr = 0;
            for (int g = 0; g < 16; g++) corr += sc[g] * bs[g];
            for (int h = 0; h < 2; h++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i c[4];
                c[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
                c[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2));
                c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, _mm256_set1_epi8(48)));
                c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                       _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char)192)), 2));
                for (int k = 0; k < 4; k++) {
                    int sub = 4 * h + k;
                    __m256i t = _mm256_maddubs_epi16(c[k], _mm256_loadu_si256((const __m256i *)(x + 32 * sub)));
                    __m256i sv = _mm256_set_m128i(_mm_set1_epi16(sc[2 * sub + 1]), _mm_set1_epi16(sc[2 * sub]));
                    p = DOT_S16(p, t, sv);
                }
            }
            p = _mm256_sub_epi32(p, _mm256_setr_epi32(32 * corr, 0, 0, 0, 0, 0, 0, 0));
            scale = FN(f16)(blk + 208) * d[b];
        } else {
            const uint8_t *blk = w + (kind == K_Q4_K ? 144 : 176) * b;
            const uint8_t *qs = blk + (kind == K_Q4_K ? 16 : 48);
            uint8_t sc[8], mn[8];
            FN(k_scales)(blk + 4, sc, mn);
            int msum = 0;
            for (int j = 0; j < 8; j++) msum += mn[j] * (bs[2 * j] + bs[2 * j + 1]);
            __m256i qh = kind == K_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (kind == K_Q5_K) {
                    __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * i))), b1 = _mm256_set1_epi8((char)(1 << (2 * i + 1)));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), _mm256_set1_epi8(16)));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), _mm256_set1_epi8(16)));
                }
                __m256i t0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x + 64 * i)));
                __m256i t1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 64 * i + 32)));
                p = DOT_S16(p, t0, _mm256_set1_epi16(sc[2 * i]));
                p = DOT_S16(p, t1, _mm256_set1_epi16(sc[2 * i + 1]));
            }
            scale = FN(f16)(blk) * d[b];
            minus = FN(f16)(blk + 2) * d[b] * (float)msum;
            acc = _mm256_sub_ps(acc, _mm256_setr_ps(minus, 0, 0, 0, 0, 0, 0, 0));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), acc);
    }
    return FN(hsum_ps)(acc);
}

/* out[i, r] = dot(x row i, w row r) (+ bias[r]) for rows [r0, r1) of w and n rows of x (already quantized). */
static void FN(rows)(const struct gemv *g, int64_t r0, int64_t r1) {
    int kq = is_k(g->kind);
    int64_t group = kq ? 256 : 32, nb = g->cols / (kq ? 256 : 32);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *w = g->w + r * g->row_bytes;
        for (int64_t i = 0; i < g->n; i++) {
            const int8_t *q = g->q + i * g->cols;
            const float *d = g->d + i * (g->cols / group);
            float v = kq ? FN(dot_k)(g->kind, w, nb, q, d, g->s16 + i * (g->cols / 16))
                         : FN(dot_q32)(g->kind, w, nb, q, d, g->s32 + i * (g->cols / 32));
            if (g->bias) v += g->bias[r];
            if (g->out_bf16) ((uint16_t *)g->out)[i * g->rows + r] = bf16_round(v);
            else ((float *)g->out)[i * g->rows + r] = v;
        }
    }
}

static void FN(quantize)(const struct gemv *g) {
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

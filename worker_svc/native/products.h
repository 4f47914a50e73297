/* The products of the native decode step: y = x w^T for up to 8 rows, the input written as
 * two int8 digits per group of 32 and the stored codes multiplied as bytes, in one of three
 * forms chosen at compile time: AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw), or a portable
 * loop. Included once, by decode.c. */
#pragma once

#include "common.h"

/* Rows x [rows, k] to two int8 digits per group of 32: hi = rint(x / e), e = max |x| / 127,
 * then lo = rint((x - hi e) / d), d = e / 127, in [-64, 64]: x ~ d (127 hi + lo). Without
 * fused multiply-adds, so that each digit is what the same float steps in torch round to
 * (tests/worker/test_native_kernels.py's round_to_digits). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void quantize_rows(int rows, int k, const float *x, const qact *a) {
#ifdef __clang__
    #pragma STDC FP_CONTRACT OFF
#endif
    const int groups = k / GROUP;
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) {
            const int64_t at = (int64_t)r * k + g * GROUP;
            const float *p = x + at;
            float top = 0.f;
            for (int i = 0; i < GROUP; i++) top = fmaxf(top, fabsf(p[i]));
            const float e = top / 127.f, d = e / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
            int total = 0;
            for (int i = 0; i < GROUP; i++) {
                const float hi = rintf(p[i] * inv);
                const int lo = (int)rintf((p[i] - hi * e) * (127.f * inv));
                a->hi[at + i] = (int8_t)hi;
                a->lo[at + i] = (int8_t)lo;
                total += 127 * (int)hi + lo;
            }
            a->d[r * groups + g] = d;
            a->sum[r * groups + g] = d * (float)total;
        }
}

/* The sum term of tile rows: bias . sum for 4-bit weights; for 8-bit ones the bias is
 * -128 * scale, so the caller passes the scales and BIAS_FACTOR(8) = -128. */
#define BIAS_FACTOR(bits) ((bits) == 4 ? 1.f : -128.f)

/* kernel(w, R, BITS, a, y) with R (rows) and BITS constants at each call site, so that the
 * kernel's loops over rows unroll into registers. */
#define ROWS_CASE(kernel, R) case R: \
    if (w->bits == 4) kernel(w, R, 4, a, y); else kernel(w, R, 8, a, y); break;
#define EACH_ROWS_AND_BITS(kernel) switch (rows) { \
    ROWS_CASE(kernel, 1) ROWS_CASE(kernel, 2) ROWS_CASE(kernel, 3) ROWS_CASE(kernel, 4) \
    ROWS_CASE(kernel, 5) ROWS_CASE(kernel, 6) ROWS_CASE(kernel, 7) ROWS_CASE(kernel, 8) }

#ifdef VNNI
/* Four rows' codes of one group (lo: elements 0-15 of each, hi: 16-31) times one int8 digit of
 * the input's group x: each row's sum in four lanes. */
static inline __m512i dot_group(__m512i lo, __m512i hi, const int8_t *x) {
    const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x));
    const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + 16)));
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
}

/* y[r, n] = sum_k w[n, k] x[r, k] over one OpenMP team (each thread a slice of the tiles),
 * reading each weight once for all R rows. R and BITS are constants at each call site
 * (matvec below), so that the row loop unrolls into registers. */
static inline __attribute__((always_inline)) void matvec_vnni(const qmat *w, const int R,
                                                              const int BITS, const qact *a,
                                                              float *y) {
    const int groups = w->k / GROUP, tiles = w->n / ROW_TILE, k = w->k;
    const int64_t tile_bytes = (BITS == 4 ? 64 : 128) * (int64_t)groups;
    const __m512i nibble = _mm512_set1_epi8(15);
    /* lane i of the products belongs to row i / 4 of the tile: each row's scale spread so */
    const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        __m512 acc[MAX_ROWS];
        __m128 bacc[MAX_ROWS];
        for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); bacc[r] = _mm_setzero_ps(); }
        const uint8_t *q = w->q + t * tile_bytes;
        const uint16_t *sc = w->scale + (int64_t)t * groups * ROW_TILE;
        const uint16_t *bi = BITS == 4 ? w->bias + (int64_t)t * groups * ROW_TILE : sc;
        for (int g = 0; g < groups; g++) {
            __m512i lo, hi;  /* elements 0-15 and 16-31 of the group, of each of four rows */
            if (BITS == 4) {
                const __m512i v = _mm512_loadu_si512(q + g * 64);
                lo = _mm512_and_si512(v, nibble);
                hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            } else {
                lo = _mm512_loadu_si512(q + g * 128);
                hi = _mm512_loadu_si512(q + g * 128 + 64);
            }
            const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + g * 4)));
            const __m128 b4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(bi + g * 4)));
            const __m512 s = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(s4));
            for (int r = 0; r < R; r++) {
                const int64_t xat = (int64_t)r * k + g * GROUP;
                const __m512i high = dot_group(lo, hi, a->hi + xat), low = dot_group(lo, hi, a->lo + xat);
                const __m512i dot = _mm512_add_epi32(  /* 127 high + low */
                    _mm512_sub_epi32(_mm512_slli_epi32(high, 7), high), low);
                const int at = r * groups + g;
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                         _mm512_mul_ps(s, _mm512_set1_ps(a->d[at])), acc[r]);
                bacc[r] = _mm_fmadd_ps(b4, _mm_set1_ps(a->sum[at]), bacc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            /* 128-bit lane j holds row j's four partial sums */
            const __m128 sums = _mm_hadd_ps(
                _mm_hadd_ps(_mm512_extractf32x4_ps(acc[r], 0), _mm512_extractf32x4_ps(acc[r], 1)),
                _mm_hadd_ps(_mm512_extractf32x4_ps(acc[r], 2), _mm512_extractf32x4_ps(acc[r], 3)));
            _mm_storeu_ps(y + (int64_t)r * w->n + t * ROW_TILE,
                          _mm_fmadd_ps(bacc[r], _mm_set1_ps(BIAS_FACTOR(BITS)), sums));
        }
    }
}

static void matvec(const qmat *w, int rows, const qact *a, float *y) {
    EACH_ROWS_AND_BITS(matvec_vnni);
}
#elif defined(AVX2_DOT)
/* Two rows' codes of one group (lo: elements 0-15 of each row, hi: 16-31) times one int8 digit
 * of the input's group x: row 0's sum in lanes 0-3, row 1's in lanes 4-7. vpmaddubsw adds
 * pairs of unsigned-by-signed byte products into int16: 4-bit codes (at most 2 * 15 * 127)
 * fit; 8-bit codes come signed, as their magnitudes with x carrying their signs (at most
 * 2 * 128 * 127). */
static inline __m256i dot_pair(__m256i lo, __m256i hi, const int8_t *x, const int SIGNED) {
    __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x));
    __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + 16)));
    if (SIGNED) {
        xl = _mm256_sign_epi8(xl, lo);
        xh = _mm256_sign_epi8(xh, hi);
        lo = _mm256_sign_epi8(lo, lo);
        hi = _mm256_sign_epi8(hi, hi);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones));
}

/* matvec_vnni's arithmetic with AVX2 alone: a tile's four rows in two halves of two rows. The
 * 8-bit codes are moved back to signed (their bias then vanishes). */
static inline __attribute__((always_inline)) void matvec_avx2(const qmat *w, const int R,
                                                              const int BITS, const qact *a,
                                                              float *y) {
    const int groups = w->k / GROUP, tiles = w->n / ROW_TILE, k = w->k;
    const int64_t tile_bytes = (BITS == 4 ? 64 : 128) * (int64_t)groups;
    const __m256i nibble = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80);
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        __m256 acc[MAX_ROWS][2];
        __m128 bacc[MAX_ROWS];
        for (int r = 0; r < R; r++) {
            acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            bacc[r] = _mm_setzero_ps();
        }
        const uint8_t *q = w->q + t * tile_bytes;
        const uint16_t *sc = w->scale + (int64_t)t * groups * ROW_TILE;
        const uint16_t *bi = BITS == 4 ? w->bias + (int64_t)t * groups * ROW_TILE : NULL;
        for (int g = 0; g < groups; g++) {
            const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(sc + g * 4)));
            for (int half = 0; half < 2; half++) {  /* rows 0-1, then 2-3 of the tile */
                __m256i lo, hi;
                if (BITS == 4) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + g * 64 + half * 32));
                    lo = _mm256_and_si256(v, nibble);
                    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                } else {
                    lo = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(q + g * 128 + half * 32)), flip);
                    hi = _mm256_xor_si256(
                        _mm256_loadu_si256((const __m256i *)(q + g * 128 + 64 + half * 32)), flip);
                }
                const __m256 s = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(s4),
                    _mm256_set_epi32(2 * half + 1, 2 * half + 1, 2 * half + 1, 2 * half + 1,
                                     2 * half, 2 * half, 2 * half, 2 * half));
                for (int r = 0; r < R; r++) {
                    const int64_t xat = (int64_t)r * k + g * GROUP;
                    const __m256i high = dot_pair(lo, hi, a->hi + xat, BITS == 8);
                    const __m256i low = dot_pair(lo, hi, a->lo + xat, BITS == 8);
                    const __m256i dot = _mm256_add_epi32(
                        _mm256_sub_epi32(_mm256_slli_epi32(high, 7), high), low);
                    acc[r][half] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(dot),
                        _mm256_mul_ps(s, _mm256_set1_ps(a->d[r * groups + g])), acc[r][half]);
                }
            }
            if (BITS == 4) {
                const __m128 b4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(bi + g * 4)));
                for (int r = 0; r < R; r++)
                    bacc[r] = _mm_fmadd_ps(b4, _mm_set1_ps(a->sum[r * groups + g]), bacc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            /* lanes: acc[r][0] rows 0 | 1, acc[r][1] rows 2 | 3, four lanes each */
            const __m256 pairs = _mm256_hadd_ps(acc[r][0], acc[r][1]);
            const __m256 sums = _mm256_hadd_ps(pairs, pairs);  /* [0, 2, 0, 2 | 1, 3, 1, 3] */
            const __m128 rows4 = _mm_unpacklo_ps(_mm256_castps256_ps128(sums),
                                                 _mm256_extractf128_ps(sums, 1));
            _mm_storeu_ps(y + (int64_t)r * w->n + t * ROW_TILE, _mm_add_ps(rows4, bacc[r]));
        }
    }
}

static void matvec(const qmat *w, int rows, const qact *a, float *y) {
    EACH_ROWS_AND_BITS(matvec_avx2);
}
#else
/* The same arithmetic without VNNI, one output at a time: for machines without it (where
 * decoder.py does not build the step unless asked) and as a reading of the layout. */
static void matvec(const qmat *w, int rows, const qact *a, float *y) {
    const int groups = w->k / GROUP, tiles = w->n / ROW_TILE;
    const int64_t tile_bytes = (w->bits == 4 ? 64 : 128) * (int64_t)groups;
    #pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        for (int j = 0; j < ROW_TILE; j++) {
            float acc[MAX_ROWS] = {0}, bacc[MAX_ROWS] = {0};
            for (int g = 0; g < groups; g++) {
                const uint8_t *q = w->q + t * tile_bytes + g * (w->bits == 4 ? 64 : 128);
                uint8_t codes[GROUP];
                for (int i = 0; i < 16; i++) {
                    codes[i] = w->bits == 4 ? q[16 * j + i] & 15 : q[16 * j + i];
                    codes[i + 16] = w->bits == 4 ? q[16 * j + i] >> 4 : q[64 + 16 * j + i];
                }
                const int64_t at = ((int64_t)t * groups + g) * ROW_TILE + j;
                const float s = half_to_float(w->scale[at]);
                const float b = half_to_float(w->bits == 4 ? w->bias[at] : w->scale[at]);
                for (int r = 0; r < rows; r++) {
                    const int64_t xat = (int64_t)r * w->k + g * GROUP;
                    int32_t dot = 0;
                    for (int i = 0; i < GROUP; i++)
                        dot += codes[i] * (127 * a->hi[xat + i] + a->lo[xat + i]);
                    acc[r] += (float)dot * (s * a->d[r * groups + g]);
                    bacc[r] += b * a->sum[r * groups + g];
                }
            }
            for (int r = 0; r < rows; r++)
                y[(int64_t)r * w->n + t * ROW_TILE + j] = acc[r] + BIAS_FACTOR(w->bits) * bacc[r];
        }
    }
}
#endif

/* Floats of scratch a quantized input of `rows` rows of k features takes. */
static int64_t qact_floats(int rows, int64_t k) { return rows * k / 2 + 2 * rows * k / GROUP; }

/* A quantized input of up to `rows` rows of k features, carved from float scratch at `at`. */
static void carve_qact(float *at, int rows, int64_t k, qact *a) {
    a->hi = (int8_t *)at;  /* rows * k bytes each: a quarter as many floats */
    a->lo = a->hi + rows * k;
    a->d = at + rows * k / 2;
    a->sum = a->d + rows * k / GROUP;
}

/* A decode step of a Llama-family model on CPU, in one call: every layer of one or a few
 * decode rows (one new token per request), from quantized weights as they are stored.
 *
 * Why: at one stream the torch path spends most of a step dispatching ~500 small ops; here the
 * whole step is one call, one OpenMP team (torch's own libgomp, loaded under the same soname),
 * and matrix-vector products that read each weight once for all rows. Activations stay float32
 * between the products; each product's input is written as two int8 digits per group of 32,
 * x ~ d * (127 q1 + q2) (a 14-bit integer, where one int8 digit as GGUF's Q8_1 cost the served
 * model 3 points of top-1 agreement with the float32 reference), so that the weights multiply
 * as bytes: with AVX-512 VNNI one vpdpbusd does 64 multiply-adds, where widening the codes to
 * floats took five instructions per 16. worker_svc/native/decoder.py builds the structs below from the loaded model and
 * compiles this file with the machine's C compiler; the torch path stays the reference
 * (tests/worker/test_native_decode.py).
 *
 * Weights: w[n, k] = q * scale[n, g] + bias[n, g], g = k / 32, q unsigned (vpdpbusd multiplies
 * unsigned bytes by signed ones): 4-bit q in 0..15, as GGUF's Q4_0 / Q4_1 blocks; 8-bit q =
 * GGUF's Q8_0 code + 128, whose bias, -128 * scale, is not stored. Scales and biases are
 * float16 (GGUF stores them so; exact). Rows are interleaved in tiles of four so that one
 * 64-byte load holds 16 codes of each of four rows: for tile t and group g,
 *   4-bit: 64 bytes, row j's 16 bytes at 16 j, byte i holding element i in its low nibble and
 *          element i + 16 in its high one;
 *   8-bit: 128 bytes, elements 0-15 of rows 0-3, then elements 16-31 of rows 0-3;
 *   scale, bias: [t, g, 4], row j of the tile at j.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VNNI 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define AVX2_DOT 1
#endif

#define GROUP 32
#define ROW_TILE 4  /* weight rows interleaved per tile */
#define MAX_ROWS 8

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

typedef struct {
    int32_t bits;          /* 4 or 8 */
    int32_t n, k;          /* out, in features; n a multiple of ROW_TILE, k of GROUP */
    const uint8_t *q;      /* 4-bit: [n / 4, k / 32, 64]; 8-bit: [n / 4, k / 32, 128] */
    const uint16_t *scale; /* float16 [n / 4, k / 32, 4] */
    const uint16_t *bias;  /* float16 [n / 4, k / 32, 4]; 4-bit only */
} qmat;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    const float *qkv_bias;                /* [q + 2 kv] or NULL */
    qmat qkv, o, gate_up, down;
    void *k_cache, *v_cache;  /* head-major storage: [kv_heads, num_blocks, block_size, head_dim] */
} layer_t;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers;
    int32_t block_size, num_blocks, cache_bf16, max_rows, max_seq_len;
    float eps, scale;
    const float *cos_sin;  /* [max_position, head_dim]: cos over the first half, sin the second */
    const layer_t *layers;
    const float *final_norm;
    qmat lm_head;
} model_t;

/* A product's input, quantized: x[r, i] ~ (127 hi[r, i] + lo[r, i]) * d[r, i / 32]. */
typedef struct {
    int8_t *hi, *lo;  /* [rows, k] each */
    float *d;         /* [rows, k / 32] */
    float *sum;       /* [rows, k / 32]: the group's sum as quantized, the bias term's factor */
} qact;

static inline f32x16 load16(const float *p) { f32x16 v; memcpy(&v, p, 64); return v; }
static inline void store16(float *p, f32x16 v) { memcpy(p, &v, 64); }
static inline float hsum(f32x16 v) {  /* a tree of four adds, not fifteen in a chain */
    typedef float f32x8 __attribute__((vector_size(32)));
    typedef float f32x4 __attribute__((vector_size(16)));
    f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    f32x8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    a += b;
    f32x4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline f32x16 bf16x16(const uint16_t *p) {
    u16x16 h; memcpy(&h, p, 32);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f; memcpy(&f, &w, 64); return f;
}
static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Rows x [rows, k] to two int8 digits per group of 32: hi = rint(x / e), e = max |x| / 127,
 * then lo = rint((x - hi e) / d), d = e / 127, in [-64, 64]: x ~ d (127 hi + lo). Without
 * fused multiply-adds, so that each digit is what the same float steps in torch round to
 * (tests/worker/test_native_decode.py's round_to_digits). */
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

#define VNNI_CASE(R) case R: \
    if (w->bits == 4) matvec_vnni(w, R, 4, a, y); else matvec_vnni(w, R, 8, a, y); break;

static void matvec(const qmat *w, int rows, const qact *a, float *y) {
    switch (rows) {
        VNNI_CASE(1) VNNI_CASE(2) VNNI_CASE(3) VNNI_CASE(4)
        VNNI_CASE(5) VNNI_CASE(6) VNNI_CASE(7) VNNI_CASE(8)
    }
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
        const uint16_t *bi = w->bias + (int64_t)t * groups * ROW_TILE;
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

#define AVX2_CASE(R) case R: \
    if (w->bits == 4) matvec_avx2(w, R, 4, a, y); else matvec_avx2(w, R, 8, a, y); break;

static void matvec(const qmat *w, int rows, const qact *a, float *y) {
    switch (rows) {
        AVX2_CASE(1) AVX2_CASE(2) AVX2_CASE(3) AVX2_CASE(4)
        AVX2_CASE(5) AVX2_CASE(6) AVX2_CASE(7) AVX2_CASE(8)
    }
}
#else
static float half_to_float(uint16_t h) {
    const uint32_t exponent = (h >> 10) & 31, mantissa = h & 1023;
    float f;
    if (exponent == 0) {
        f = ldexpf((float)mantissa, -24);  /* zero or subnormal */
    } else {
        const uint32_t u = exponent == 31 ? 0x7f800000u | (mantissa << 13)
                                          : ((exponent + 112) << 23) | (mantissa << 13);
        memcpy(&f, &u, 4);
    }
    return h & 0x8000 ? -f : f;
}

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

/* e^x, in a form the compiler vectorizes (the scalar expf of the C library does not, and the
 * softmax and SiLU call it for every score and every intermediate feature): x = n ln2 + r,
 * e^r by Cephes' degree-6 polynomial, 2^n put into the exponent bits. Within 2 ulp of expf
 * over [-87.3, 88.3]; clamped there (e^-87.3 is the smallest normal float). */
static inline float fast_exp(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return e * scale;
}

/* out = rms_norm(x) * weight, in float32 (torch's rms_norm: x * rsqrt(mean(x^2) + eps)). */
static void rms_norm(int n, const float *x, const float *weight, float eps, float *out) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* out = rms_norm(x) * weight for each row, quantized (the next product's input). */
static void norm_rows(int rows, int n, const float *x, const float *weight, float eps, float *out,
                      const qact *a) {
    for (int r = 0; r < rows; r++)
        rms_norm(n, x + (int64_t)r * n, weight, eps, out + (int64_t)r * n);
    quantize_rows(rows, n, out, a);
}

/* Neox-style rotary on one head in place: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
static void rotate(float *x, const float *cos_sin, int head_dim) {
    const int half = head_dim / 2;
    const float *c = cos_sin, *s = cos_sin + half;
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
    }
}

static inline int64_t cache_row(const model_t *m, int kv_head, int64_t slot) {
    const int64_t block = slot / m->block_size, offset = slot % m->block_size;
    return (((int64_t)kv_head * m->num_blocks + block) * m->block_size + offset) * m->head_dim;
}

static void write_cache(const model_t *m, void *cache, int kv_head, int64_t slot, const float *v) {
    const int64_t at = cache_row(m, kv_head, slot);
    if (m->cache_bf16) {
        uint16_t *c = (uint16_t *)cache + at;
        for (int i = 0; i < m->head_dim; i++) c[i] = to_bf16(v[i]);
    } else {
        memcpy((float *)cache + at, v, sizeof(float) * m->head_dim);
    }
}

#define CHUNK 128          /* positions per attention work item: items enough for every thread */
#define MAX_HEAD_DIM 256

/* Row j of a K or V cache block as floats; V = head_dim / 16. */
static inline __attribute__((always_inline)) void cache_floats(const model_t *m, const void *block,
                                                               int j, const int V, f32x16 *out) {
    for (int i = 0; i < V; i++)
        out[i] = m->cache_bf16 ? bf16x16((const uint16_t *)block + (int64_t)j * 16 * V + 16 * i)
                               : load16((const float *)block + (int64_t)j * 16 * V + 16 * i);
}

/* Where position t of a row's context starts its run of consecutive cache rows: the block
 * holding it (head-major storage: its rows are contiguous), t's row in it, and the run's
 * length up to `end`. One division per block rather than per position. */
static inline const void *cache_run(const model_t *m, const void *cache, int kv_head,
                                    const int32_t *blocks, int t, int end, int *first, int *run) {
    const int b = t / m->block_size;
    *first = t - b * m->block_size;
    *run = m->block_size - *first < end - t ? m->block_size - *first : end - t;
    const int64_t at = ((int64_t)kv_head * m->num_blocks + blocks[b]) * m->block_size * m->head_dim;
    return m->cache_bf16 ? (const void *)((const uint16_t *)cache + at)
                         : (const void *)((const float *)cache + at);
}

/* The `group` query heads that share kv_head (q [group, D]) over one row's positions [t0, t1),
 * each K row read once for all of them. Per head into part [group, 2 + D]: the largest score,
 * the sum of exp(score - largest), and the V rows summed with those weights (unnormalised);
 * combine_chunks joins a row's chunks. scores: [group, CHUNK] of the thread. V = D / 16 is a
 * constant at each call site (attend_chunk below) so that a head's sums stay in registers. */
static inline __attribute__((always_inline)) void attend_chunk_v(
        const model_t *m, const layer_t *l, const int32_t *blocks, int t0, int t1,
        const float *q, int kv_head, int group, float *scores, float *part, const int V) {
    const int D = 16 * V, n = t1 - t0;
    f32x16 row[MAX_HEAD_DIM / 16];
    for (int t = t0; t < t1;) {
        int first, run;
        const void *block = cache_run(m, l->k_cache, kv_head, blocks, t, t1, &first, &run);
        for (int j = 0; j < run; j++, t++) {
            cache_floats(m, block, first + j, V, row);
            for (int h = 0; h < group; h++) {
                f32x16 acc = {0};
                for (int i = 0; i < V; i++) acc += row[i] * load16(q + h * D + 16 * i);
                scores[h * CHUNK + t - t0] = hsum(acc) * m->scale;
            }
        }
    }
    for (int h = 0; h < group; h++) {
        float *s = scores + h * CHUNK, *head = part + h * (2 + D), top = -INFINITY, total = 0.f;
        for (int t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
        for (int t = 0; t < n; t++) s[t] = fast_exp(s[t] - top);  /* apart: this loop vectorizes */
        for (int t = 0; t < n; t++) total += s[t];
        head[0] = top;
        head[1] = total;
    }
    /* The weighted V rows: each row converted once for up to four heads, whose sums stay in
     * registers (the loop over h unrolls: its bound is a constant, `group` a guard). */
    for (int h0 = 0; h0 < group; h0 += 4) {
        f32x16 out[4][MAX_HEAD_DIM / 16];
        for (int h = 0; h < 4; h++)
            for (int i = 0; i < V; i++) out[h][i] = (f32x16){0};
        for (int t = t0; t < t1;) {
            int first, run;
            const void *block = cache_run(m, l->v_cache, kv_head, blocks, t, t1, &first, &run);
            for (int j = 0; j < run; j++, t++) {
                cache_floats(m, block, first + j, V, row);
                #pragma GCC unroll 4
                for (int h = 0; h < 4; h++) {
                    if (h0 + h >= group) break;
                    const float p = scores[(h0 + h) * CHUNK + t - t0];
                    for (int i = 0; i < V; i++) out[h][i] += row[i] * p;
                }
            }
        }
        for (int h = 0; h < 4 && h0 + h < group; h++)
            for (int i = 0; i < V; i++) store16(part + (h0 + h) * (2 + D) + 2 + 16 * i, out[h][i]);
    }
}

static void attend_chunk(const model_t *m, const layer_t *l, const int32_t *blocks, int t0,
                         int t1, const float *q, int kv_head, int group, float *scores,
                         float *part) {
    switch (m->head_dim) {  /* the common head sizes unrolled; any multiple of 16 served */
        case 64: attend_chunk_v(m, l, blocks, t0, t1, q, kv_head, group, scores, part, 4); break;
        case 128: attend_chunk_v(m, l, blocks, t0, t1, q, kv_head, group, scores, part, 8); break;
        default:
            attend_chunk_v(m, l, blocks, t0, t1, q, kv_head, group, scores, part,
                           m->head_dim / 16);
    }
}

/* One head's attention output from its chunks' parts (chunk c at part + c * stride). */
static void combine_chunks(int chunks, int D, const float *part, int64_t stride, float *out) {
    float top = -INFINITY, total = 0.f;
    for (int c = 0; c < chunks; c++) top = part[c * stride] > top ? part[c * stride] : top;
    memset(out, 0, sizeof(float) * D);
    for (int c = 0; c < chunks; c++) {
        const float *p = part + c * stride, w = fast_exp(p[0] - top);
        total += w * p[1];
        for (int i = 0; i < D; i++) out[i] += w * p[2 + i];
    }
    for (int i = 0; i < D; i++) out[i] /= total;
}

/* Floats of scratch attend_rows takes for `rows` rows and `threads` threads: each head's part
 * of each chunk, and each thread's scores. */
static int64_t attention_floats(const model_t *m, int rows, int threads) {
    const int64_t chunks = (m->max_seq_len + CHUNK - 1) / CHUNK;
    return rows * (int64_t)m->num_heads * chunks * (2 + m->head_dim) +
           (int64_t)threads * m->num_heads * CHUNK;
}

/* Attention of `rows` decode rows of layer l, inside the caller's OpenMP team: row r's query
 * heads at q + r * q_stride (rotated; this step's K/V already in the cache), its output heads
 * at out + r * num_heads * head_dim. Work items are (row, KV head, chunk of CHUNK positions),
 * so that even one row's context is shared among the threads; then each head's chunks join. */
static void attend_rows(const model_t *m, const layer_t *l, int rows, const float *q,
                        int64_t q_stride, const int32_t *block_table, int table_width,
                        const int32_t *seq_lens, float *out, float *scratch) {
    const int D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads, group = NH / NKV;
    const int chunks_max = (m->max_seq_len + CHUNK - 1) / CHUNK;
    const int64_t part_size = 2 + D;  /* one head's part of one chunk */
    float *parts = scratch;           /* [rows, NKV, chunks_max, group, part_size] */
    float *scores = parts + rows * (int64_t)NH * chunks_max * part_size;  /* [threads, group,
                                                                             CHUNK] */
    int step_chunks = 0;  /* the most chunks of any row this step */
    for (int r = 0; r < rows; r++)
        if ((seq_lens[r] + CHUNK - 1) / CHUNK > step_chunks)
            step_chunks = (seq_lens[r] + CHUNK - 1) / CHUNK;
    #pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < rows * NKV * step_chunks; item++) {
        const int c = item % step_chunks, kv_head = item / step_chunks % NKV;
        const int r = item / (step_chunks * NKV), t0 = c * CHUNK;
        if (t0 >= seq_lens[r]) continue;
        const int t1 = t0 + CHUNK < seq_lens[r] ? t0 + CHUNK : seq_lens[r];
        attend_chunk(m, l, block_table + (int64_t)r * table_width, t0, t1,
                     q + r * q_stride + kv_head * group * D, kv_head, group,
                     scores + (int64_t)omp_get_thread_num() * group * CHUNK,
                     parts + (((int64_t)r * NKV + kv_head) * chunks_max + c) * group * part_size);
    }
    #pragma omp for schedule(static)
    for (int item = 0; item < rows * NH; item++) {
        const int r = item / NH, head = item % NH, kv_head = head / group;
        combine_chunks((seq_lens[r] + CHUNK - 1) / CHUNK, D,
                       parts + ((int64_t)r * NKV + kv_head) * chunks_max * group * part_size +
                           (head % group) * part_size,
                       group * part_size, out + (int64_t)r * NH * D + head * D);
    }
}

/* Floats of scratch a quantized input of `rows` rows of k features takes. */
static int64_t qact_floats(int rows, int64_t k) { return rows * k / 2 + 2 * rows * k / GROUP; }

/* A quantized input of up to `rows` rows of k features, carved from float scratch at `at`. */
static void carve_qact(float *at, int rows, int64_t k, qact *a) {
    a->hi = (int8_t *)at;  /* rows * k bytes each: a quarter as many floats */
    a->lo = a->hi + rows * k;
    a->d = at + rows * k / 2;
    a->sum = a->d + rows * k / GROUP;
}

static int64_t widest_input(const model_t *m) {
    int64_t k_max = m->intermediate > m->hidden ? m->intermediate : m->hidden;
    const int64_t q_size = (int64_t)m->num_heads * m->head_dim;
    return q_size > k_max ? q_size : k_max;
}

/* Scratch floats bw_decode (and bw_lm_head) need for `rows` rows and `threads` threads. */
int64_t bw_scratch_floats(const model_t *m, int rows, int threads) {
    const int64_t qkv = (int64_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int64_t widest = 2 * (int64_t)m->intermediate > qkv ? 2 * (int64_t)m->intermediate : qkv;
    const int64_t k_max = widest_input(m);
    return rows * (2 * (int64_t)m->hidden + widest + k_max) + qact_floats(rows, k_max) +
           attention_floats(m, rows, threads);
}

/* Every layer of `rows` decode rows. x [rows, hidden]: the embedded tokens in, the final-normed
 * hidden states out. positions [rows]; block_table [rows, table_width]; seq_lens [rows] (the
 * context after this step's token). Returns 0, or -1 when the arguments do not fit. */
int bw_decode(const model_t *m, int rows, float *x, const int64_t *positions,
              const int32_t *block_table, int table_width, const int32_t *seq_lens,
              float *scratch, int threads) {
    if (rows < 1 || rows > MAX_ROWS || rows > m->max_rows) return -1;
    for (int r = 0; r < rows; r++)
        if (seq_lens[r] < 1 || seq_lens[r] > m->max_seq_len || positions[r] != seq_lens[r] - 1 ||
            (seq_lens[r] - 1) / m->block_size >= table_width)
            return -1;
    const int H = m->hidden, D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads;
    const int QKV = (NH + 2 * NKV) * D, I = m->intermediate;
    const int widest = 2 * I > QKV ? 2 * I : QKV;
    const int64_t k_max = widest_input(m);
    float *resid = x;                              /* [rows, H], the residual stream */
    float *h = scratch;                            /* [rows, H] normed input of a projection */
    float *tmp = h + (int64_t)rows * H;            /* [rows, H] a projection's output */
    float *wide = tmp + (int64_t)rows * H;         /* [rows, widest] q|k|v or gate|up */
    float *act = wide + (int64_t)rows * widest;    /* [rows, k_max] attention out / silu(g)*u */
    qact in;                                       /* the quantized input of a product */
    carve_qact(act + rows * k_max, rows, k_max, &in);
    float *attention_scratch = act + rows * k_max + qact_floats(rows, k_max);

    #pragma omp parallel num_threads(threads)
    {
        for (int li = 0; li < m->num_layers; li++) {
            const layer_t *l = &m->layers[li];
            #pragma omp single
            norm_rows(rows, H, resid, l->input_norm, m->eps, h, &in);
            matvec(&l->qkv, rows, &in, wide);
            #pragma omp single
            for (int r = 0; r < rows; r++) {
                float *row = wide + (int64_t)r * QKV;
                if (l->qkv_bias) for (int i = 0; i < QKV; i++) row[i] += l->qkv_bias[i];
                const float *cs = m->cos_sin + positions[r] * D;
                for (int hd = 0; hd < NH + NKV; hd++) rotate(row + hd * D, cs, D);
                const int64_t t = positions[r];
                const int64_t slot = (int64_t)block_table[(int64_t)r * table_width + t / m->block_size] *
                                     m->block_size + t % m->block_size;
                for (int g = 0; g < NKV; g++) {
                    write_cache(m, l->k_cache, g, slot, row + (NH + g) * D);
                    write_cache(m, l->v_cache, g, slot, row + (NH + NKV + g) * D);
                }
            }
            attend_rows(m, l, rows, wide, QKV, block_table, table_width, seq_lens, act,
                        attention_scratch);
            #pragma omp single
            quantize_rows(rows, NH * D, act, &in);
            matvec(&l->o, rows, &in, tmp);
            #pragma omp single
            {
                for (int64_t i = 0; i < (int64_t)rows * H; i++) resid[i] += tmp[i];
                norm_rows(rows, H, resid, l->post_norm, m->eps, h, &in);
            }
            matvec(&l->gate_up, rows, &in, wide);
            #pragma omp single
            {
                for (int r = 0; r < rows; r++) {
                    const float *gate = wide + (int64_t)r * 2 * I, *up = gate + I;
                    float *a = act + (int64_t)r * I;
                    for (int i = 0; i < I; i++) a[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];
                }
                quantize_rows(rows, I, act, &in);
            }
            matvec(&l->down, rows, &in, tmp);
            #pragma omp single
            for (int64_t i = 0; i < (int64_t)rows * H; i++) resid[i] += tmp[i];
        }
        #pragma omp single
        for (int r = 0; r < rows; r++) {
            rms_norm(H, resid + (int64_t)r * H, m->final_norm, m->eps, h + (int64_t)r * H);
            memcpy(resid + (int64_t)r * H, h + (int64_t)r * H, sizeof(float) * H);
        }
    }
    return 0;
}

/* Attention alone, for the torch path's steps of more decode rows than bw_decode takes:
 * q [rows, num_heads * head_dim] float32 (rotated; this step's K/V already written by the
 * torch path), out likewise; scratch: bw_attention_floats(m, rows, threads). Returns 0, or -1
 * when the arguments do not fit. */
int bw_attend(const model_t *m, int layer, int rows, const float *q, const int32_t *block_table,
              int table_width, const int32_t *seq_lens, float *out, float *scratch,
              int threads) {
    if (rows < 1 || layer < 0 || layer >= m->num_layers) return -1;
    for (int r = 0; r < rows; r++)
        if (seq_lens[r] < 1 || seq_lens[r] > m->max_seq_len ||
            (seq_lens[r] - 1) / m->block_size >= table_width)
            return -1;
    #pragma omp parallel num_threads(threads)
    attend_rows(m, &m->layers[layer], rows, q, (int64_t)m->num_heads * m->head_dim,
                block_table, table_width, seq_lens, out, scratch);
    return 0;
}

int64_t bw_attention_floats(const model_t *m, int rows, int threads) {
    return attention_floats(m, rows, threads);
}

/* logits [rows, vocab] = lm_head(h [rows, hidden]), in float32. */
int bw_lm_head(const model_t *m, int rows, const float *h, float *logits, float *scratch,
               int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    qact in;
    carve_qact(scratch, rows, m->hidden, &in);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp single
        quantize_rows(rows, m->hidden, h, &in);
        matvec(&m->lm_head, rows, &in, logits);
    }
    return 0;
}

/* y [rows, n] = x [rows, k] w^T, as each product of the step computes it (for tests). scratch:
 * rows * k / 2 + rows * k / 16 floats. */
int bw_matvec(const qmat *w, int rows, const float *x, float *y, float *scratch, int threads) {
    if (rows < 1 || rows > MAX_ROWS || w->n % ROW_TILE || w->k % GROUP) return -1;
    qact in;
    carve_qact(scratch, rows, w->k, &in);
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp single
        quantize_rows(rows, w->k, x, &in);
        matvec(w, rows, &in, y);
    }
    return 0;
}

/* What the products run on: "avx512-vnni", "avx2", or "portable" (decoder.py builds the step
 * on the first two). */
const char *bw_products(void) {
#if defined(VNNI)
    return "avx512-vnni";
#elif defined(AVX2_DOT)
    return "avx2";
#else
    return "portable";
#endif
}

/* What every part of the native decode step shares: the structs decoder.py fills (library.py
 * mirrors them in ctypes), and small vector helpers. Included once, by decode.c. */
#pragma once

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

/* A float16 scale or bias, widened without F16C (every build has this one). */
static inline float half_to_float(uint16_t h) {
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
static inline float hmax(f32x16 v) {
#ifdef __AVX512F__
    return _mm512_reduce_max_ps((__m512)v);
#else
    float top = v[0];
    for (int i = 1; i < 16; i++) top = v[i] > top ? v[i] : top;
    return top;
#endif
}
static inline f32x16 bf16x16(const uint16_t *p) {
#ifdef __AVX512F__  /* one widening instruction (the generic form splits it in halves) */
    const __m512i w = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (f32x16)_mm512_castsi512_ps(w);
#else
    u16x16 h; memcpy(&h, p, 32);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    f32x16 f; memcpy(&f, &w, 64); return f;
#endif
}
/* Round to nearest even, as torch's .to(bfloat16); without branches, so loops of it vectorize. */
static inline uint16_t to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40;  /* quiet */
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

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

/* A decode step of a Llama-family model on CPU, in one call: every layer of one or a few
 * decode rows (one new token per request), from quantized weights as they are stored.
 *
 * Why: at one stream the torch path spends most of a step dispatching ~500 small ops; here the
 * whole step is one call, one OpenMP team (torch's own libgomp, loaded under the same soname),
 * float32 activations, and matrix-vector products that read each weight once for all rows.
 * worker_svc/native/decoder.py builds the structs below from the loaded model and compiles this
 * file with the machine's C compiler; the torch path stays the reference
 * (tests/worker/test_native_decode.py).
 *
 * Weights: w[n, k] = q * scale[n, g] + bias[n, g], g = k / 32, q unsigned (widening unsigned bytes
 * to floats takes fewer instructions than signed ones): 4-bit q in 0..15 packed two per byte,
 * byte j of a group holding element j in its low nibble and j + 16 in its high one, as GGUF's
 * Q4_0 / Q4_1 blocks; 8-bit q = GGUF's Q8_0 code + 128, whose bias, -128 * scale, is not stored.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* 16 unsigned bytes to floats: widen, then convert. With AVX-512 or AVX2 the instructions are
 * spelled out: compilers split some vector-extension forms of it into scalar code. */
static inline f32x16 u8_to_f32(u8x16 b) {
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b));
    f32x16 out; memcpy(&out, &f, 64); return out;
#elif defined(__AVX2__)
    __m256 halves[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((__m128i)b)),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)b, 8)))};
    f32x16 out; memcpy(&out, halves, 64); return out;
#else
    return __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16);
#endif
}

typedef struct {
    int32_t bits;        /* 4 or 8 */
    int32_t n, k;        /* out, in features */
    const uint8_t *q;    /* 4-bit: [n, k / 2]; 8-bit: [n, k] */
    const float *scale;  /* [n, k / 32] */
    const float *bias;   /* [n, k / 32]; 4-bit only */
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

#define MAX_ROWS 8
#define TILE 4  /* output features per pass at one row: four independent sums in flight */

/* The bias term of row n: sum_g bias[n, g] * xsum[g]. 8-bit weights store no bias: theirs is
 * -128 * scale, derived here rather than read (a ninth of the LM head's bytes). */
static float bias_dot(const qmat *w, int64_t n, const float *xsum) {
    const int groups = w->k / GROUP;
    const float *b = w->bits == 4 ? w->bias + n * groups : w->scale + n * groups;
    float s = 0.f;
    for (int g = 0; g < groups; g++) s += b[g] * xsum[g];
    return w->bits == 4 ? s : -128.f * s;
}

/* Group g of row n as 32 floats (lo: elements 0-15, hi: 16-31), before scale and bias. */
static inline void unpack(const qmat *w, int64_t n, int g, f32x16 *lo, f32x16 *hi) {
    if (w->bits == 4) {
        u8x16 b; memcpy(&b, w->q + n * (w->k / 2) + g * 16, 16);
        *lo = u8_to_f32(b & 15);
        *hi = u8_to_f32(b >> 4);
    } else {
        u8x16 a, b;
        memcpy(&a, w->q + n * w->k + g * GROUP, 16);
        memcpy(&b, w->q + n * w->k + g * GROUP + 16, 16);
        *lo = u8_to_f32(a);
        *hi = u8_to_f32(b);
    }
}

/* One row of x: TILE output features at a time, so that TILE sums are in flight. */
static void matvec_row(const qmat *w, const float *x, const float *xsum, float *y) {
    const int groups = w->k / GROUP, tiles = w->n / TILE;
    #pragma omp for schedule(static)
    for (int tile = 0; tile < tiles; tile++) {
        const int n0 = tile * TILE;
        f32x16 acc[TILE] = {{0}};
        for (int g = 0; g < groups; g++) {
            const f32x16 xl = load16(x + g * GROUP), xh = load16(x + g * GROUP + 16);
            for (int t = 0; t < TILE; t++) {
                f32x16 lo, hi;
                unpack(w, n0 + t, g, &lo, &hi);
                acc[t] += (lo * xl + hi * xh) * w->scale[(int64_t)(n0 + t) * groups + g];
            }
        }
        for (int t = 0; t < TILE; t++) {
            const int64_t n = n0 + t;
            y[n] = hsum(acc[t]) + bias_dot(w, n, xsum);
        }
    }
}

/* y[r, n] = sum_k w[n, k] x[r, k] for rows r < rows: each thread a slice of n, reading each
 * weight once for all rows. xsum[r, g]: the sum of x[r] over group g (the bias term's factor). */
static void matvec(const qmat *w, int rows, const float *x, const float *xsum, float *y) {
    const int groups = w->k / GROUP;
    if (rows == 1 && w->n % TILE == 0) {
        matvec_row(w, x, xsum, y);
        return;
    }
    #pragma omp for schedule(static)
    for (int n = 0; n < w->n; n++) {
        f32x16 acc[MAX_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = (f32x16){0};
        const float *sc = w->scale + (int64_t)n * groups;
        for (int g = 0; g < groups; g++) {
            f32x16 lo, hi;
            unpack(w, n, g, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                const float *xr = x + (int64_t)r * w->k + g * GROUP;
                acc[r] += (lo * load16(xr) + hi * load16(xr + 16)) * sc[g];
            }
        }
        for (int r = 0; r < rows; r++)
            y[(int64_t)r * w->n + n] = hsum(acc[r]) + bias_dot(w, n, xsum + (int64_t)r * groups);
    }
}

/* Group sums of x [rows, k], for the bias term. Called by one thread. */
static void group_sums(int rows, int k, const float *x, float *xsum) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < k / GROUP; g++) {
            const float *p = x + (int64_t)r * k + g * GROUP;
            xsum[r * (k / GROUP) + g] = hsum(load16(p) + load16(p + 16));
        }
}

/* out = rms_norm(x) * weight, in float32 (torch's rms_norm: x * rsqrt(mean(x^2) + eps)). */
static void rms_norm(int n, const float *x, const float *weight, float eps, float *out) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
}

/* out = rms_norm(x) * weight for each row, and out's group sums (the next matvec's input). */
static void norm_rows(int rows, int n, const float *x, const float *weight, float eps, float *out,
                      float *xsum) {
    for (int r = 0; r < rows; r++)
        rms_norm(n, x + (int64_t)r * n, weight, eps, out + (int64_t)r * n);
    group_sums(rows, n, out, xsum);
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

static inline float dot_cache(const model_t *m, const void *cache, int64_t at, const float *q) {
    f32x16 acc = {0};
    if (m->cache_bf16) {
        const uint16_t *c = (const uint16_t *)cache + at;
        for (int i = 0; i < m->head_dim; i += 16) acc += bf16x16(c + i) * load16(q + i);
    } else {
        const float *c = (const float *)cache + at;
        for (int i = 0; i < m->head_dim; i += 16) acc += load16(c + i) * load16(q + i);
    }
    return hsum(acc);
}

static inline void add_cache(const model_t *m, const void *cache, int64_t at, float p, float *out) {
    if (m->cache_bf16) {
        const uint16_t *c = (const uint16_t *)cache + at;
        for (int i = 0; i < m->head_dim; i += 16) store16(out + i, load16(out + i) + bf16x16(c + i) * p);
    } else {
        const float *c = (const float *)cache + at;
        for (int i = 0; i < m->head_dim; i += 16) store16(out + i, load16(out + i) + load16(c + i) * p);
    }
}

/* One query head of one row over its request's cached positions [0, seq_len). */
static void attend_head(const model_t *m, const layer_t *l, const int32_t *blocks, int seq_len,
                        const float *q, int kv_head, float *scores, float *out) {
    float top = -INFINITY;
    for (int t = 0; t < seq_len; t++) {
        const int64_t slot = (int64_t)blocks[t / m->block_size] * m->block_size + t % m->block_size;
        scores[t] = dot_cache(m, l->k_cache, cache_row(m, kv_head, slot), q) * m->scale;
        if (scores[t] > top) top = scores[t];
    }
    float total = 0.f;
    for (int t = 0; t < seq_len; t++) { scores[t] = expf(scores[t] - top); total += scores[t]; }
    memset(out, 0, sizeof(float) * m->head_dim);
    for (int t = 0; t < seq_len; t++) {
        const int64_t slot = (int64_t)blocks[t / m->block_size] * m->block_size + t % m->block_size;
        add_cache(m, l->v_cache, cache_row(m, kv_head, slot), scores[t] / total, out);
    }
}

/* Scratch floats bw_decode needs for `rows` rows and `threads` threads. */
int64_t bw_scratch_floats(const model_t *m, int rows, int threads) {
    const int64_t qkv = (int64_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int64_t widest = 2 * (int64_t)m->intermediate > qkv ? 2 * (int64_t)m->intermediate : qkv;
    const int64_t q_size = (int64_t)m->num_heads * m->head_dim;
    int64_t k_max = m->intermediate > m->hidden ? m->intermediate : m->hidden;
    if (q_size > k_max) k_max = q_size;
    return rows * (2 * (int64_t)m->hidden + widest + k_max + k_max / GROUP) +
           (int64_t)threads * m->max_seq_len;
}

/* Every layer of `rows` decode rows. x [rows, hidden]: the embedded tokens in, the final-normed
 * hidden states out. positions [rows]; block_table [rows, table_width]; seq_lens [rows] (the
 * context after this step's token). Returns 0, or -1 when the arguments do not fit. */
int bw_decode(const model_t *m, int rows, float *x, const int64_t *positions,
              const int32_t *block_table, int table_width, const int32_t *seq_lens,
              float *scratch, int threads) {
    if (rows < 1 || rows > MAX_ROWS || rows > m->max_rows) return -1;
    for (int r = 0; r < rows; r++)
        if (seq_lens[r] < 1 || seq_lens[r] > m->max_seq_len || positions[r] != seq_lens[r] - 1)
            return -1;
    const int H = m->hidden, D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads;
    const int QKV = (NH + 2 * NKV) * D, I = m->intermediate;
    const int widest = 2 * I > QKV ? 2 * I : QKV;
    int k_max = I > H ? I : H;
    if (NH * D > k_max) k_max = NH * D;
    float *resid = x;                              /* [rows, H], the residual stream */
    float *h = scratch;                            /* [rows, H] normed input of a projection */
    float *tmp = h + (int64_t)rows * H;            /* [rows, H] a projection's output */
    float *wide = tmp + (int64_t)rows * H;         /* [rows, widest] q|k|v or gate|up */
    float *act = wide + (int64_t)rows * widest;    /* [rows, k_max] attention out / silu(g)*u */
    float *xsum = act + (int64_t)rows * k_max;     /* [rows, k_max / 32] group sums */
    float *scores = xsum + (int64_t)rows * (k_max / GROUP);  /* [threads, max_seq_len] */
    const int group_size = NH / NKV;

    #pragma omp parallel num_threads(threads)
    {
        for (int li = 0; li < m->num_layers; li++) {
            const layer_t *l = &m->layers[li];
            #pragma omp single
            norm_rows(rows, H, resid, l->input_norm, m->eps, h, xsum);
            matvec(&l->qkv, rows, h, xsum, wide);
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
            #pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < rows * NH; item++) {
                const int r = item / NH, head = item % NH;
                float *my_scores = scores + (int64_t)omp_get_thread_num() * m->max_seq_len;
                attend_head(m, l, block_table + (int64_t)r * table_width, seq_lens[r],
                            wide + (int64_t)r * QKV + head * D, head / group_size, my_scores,
                            act + (int64_t)r * NH * D + head * D);
            }
            #pragma omp single
            group_sums(rows, NH * D, act, xsum);
            matvec(&l->o, rows, act, xsum, tmp);
            #pragma omp single
            {
                for (int64_t i = 0; i < (int64_t)rows * H; i++) resid[i] += tmp[i];
                norm_rows(rows, H, resid, l->post_norm, m->eps, h, xsum);
            }
            matvec(&l->gate_up, rows, h, xsum, wide);
            #pragma omp single
            {
                for (int r = 0; r < rows; r++) {
                    const float *gate = wide + (int64_t)r * 2 * I, *up = gate + I;
                    float *a = act + (int64_t)r * I;
                    for (int i = 0; i < I; i++) a[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
                }
                group_sums(rows, I, act, xsum);
            }
            matvec(&l->down, rows, act, xsum, tmp);
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

/* logits [rows, vocab] = lm_head(h [rows, hidden]), in float32. */
int bw_lm_head(const model_t *m, int rows, const float *h, float *logits, float *scratch,
               int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp single
        group_sums(rows, m->hidden, h, scratch);
        matvec(&m->lm_head, rows, h, scratch, logits);
    }
    return 0;
}

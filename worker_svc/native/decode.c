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
 * floats took five instructions per 16. worker_svc/native/decoder.py builds the structs (in
 * common.h) from the loaded model, and library.py compiles this file, with the parts it
 * includes (products.h: the products; attention.h: attention over the paged cache; rows.h: the
 * norm, rotary, the K/V write and SiLU of a row; between.h: those parts alone, called between
 * torch's products for steps of more rows; head.h: the exact top logits of those steps), with
 * the machine's C compiler; the torch path stays the reference
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
#include "attention.h"
#include "between.h"
#include "common.h"
#include "head.h"
#include "products.h"
#include "rows.h"

/* out = rms_norm(x) * weight for each row, quantized (the next product's input). */
static void norm_rows(int rows, int n, const float *x, const float *weight, float eps, float *out,
                      const qact *a) {
    for (int r = 0; r < rows; r++)
        rms_norm(n, x + (int64_t)r * n, weight, eps, out + (int64_t)r * n);
    quantize_rows(rows, n, out, a);
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
           attention_floats(m, rows, m->max_seq_len, threads);
}

/* Every layer of `rows` decode rows. x [rows, hidden]: the embedded tokens in, the final-normed
 * hidden states out. positions [rows]; block_table [rows, table_width]; seq_lens [rows] (the
 * context after this step's token). Returns 0, or -1 when the arguments do not fit. */
int bw_decode(const model_t *m, int rows, float *x, const int64_t *positions,
              const int32_t *block_table, int table_width, const int32_t *seq_lens,
              float *scratch, int threads) {
    if (rows < 1 || rows > MAX_ROWS || rows > m->max_rows ||
        !rows_fit(m, rows, positions, table_width, seq_lens))
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
            for (int r = 0; r < rows; r++)
                write_row_kv(m, l, wide + (int64_t)r * QKV, l->qkv_bias, positions[r],
                             block_table + (int64_t)r * table_width);
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
                    const float *gate = wide + (int64_t)r * 2 * I;
                    silu_mul(I, gate, gate + I, act + (int64_t)r * I);
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

/* Attention alone, for the torch path's decode steps (NativeAttention: steps with adapters):
 * q [rows, num_heads * head_dim] float32 (rotated; this step's K/V already written by the
 * torch path), out likewise; scratch: bw_attention_floats(m, rows, the longest seq_len,
 * threads). Returns 0, or -1 when the arguments do not fit. */
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

int64_t bw_attention_floats(const model_t *m, int rows, int max_len, int threads) {
    return attention_floats(m, rows, max_len, threads);
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

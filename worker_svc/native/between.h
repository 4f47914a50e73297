/* The parts of a layer between its products, for every step bw_decode does not take (more
 * than MAX_ROWS decode rows, prompt chunks: decoder.py's NativeDecoder.between). There the
 * products are matrix-matrix, and torch's GEMMs (oneDNN, bfloat16 on AMX or AVX-512) beat the
 * byte products of products.h; but the torch path also spends ~40% of a 64-row decode step on
 * the ~15 small ops around them (norms, casts, rotary, the cache write, SiLU), each a dispatch
 * and a pass over memory, and a prompt chunk's attention there is a few small matmuls per
 * request and head. Here each stretch between two products is one call: the residual add and
 * the norm; rotary, the K/V write and attention; SiLU times up. A row is one token: a decode
 * row, or a prompt token attending its context up to itself. Activations cross in the
 * products' dtype (bfloat16 or float32: `bf16`), the residual stream stays float32. Included
 * once, by decode.c. */
#pragma once

#include "attention.h"
#include "common.h"
#include "rows.h"

static void to_floats(const void *src, int bf16, int64_t n, float *dst) {
    if (!bf16) { memcpy(dst, src, sizeof(float) * n); return; }
    const uint16_t *s = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = (uint32_t)s[i] << 16;
        memcpy(dst + i, &u, 4);
    }
}

static void from_floats(const float *src, int64_t n, int bf16, void *dst) {
    if (!bf16) { memcpy(dst, src, sizeof(float) * n); return; }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i]);
}

/* resid [rows, H] float32 += add [rows, H] (NULL: nothing to add); out [rows, H] =
 * rms_norm(resid) * weight, in the products' dtype. weight: float32 [H]. */
int bw_add_norm(const model_t *m, const float *weight, int rows, float *resid, const void *add,
                void *out, int bf16, int threads) {
    const int H = m->hidden;
    #pragma omp parallel num_threads(threads)
    {
        float normed[H];
        #pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            float *x = resid + (int64_t)r * H;
            if (add != NULL) {
                to_floats((const char *)add + (int64_t)r * H * (bf16 ? 2 : 4), bf16, H, normed);
                for (int i = 0; i < H; i++) x[i] += normed[i];
            }
            rms_norm(H, x, weight, m->eps, normed);
            from_floats(normed, H, bf16, (char *)out + (int64_t)r * H * (bf16 ? 2 : 4));
        }
    }
    return 0;
}

/* Floats of scratch bw_attend_qkv takes for `rows` rows whose contexts are at most max_len
 * long: each row's q|k|v and attention output in float32, and attend_rows' own. */
int64_t bw_attend_qkv_floats(const model_t *m, int rows, int max_len, int threads) {
    const int64_t qkv = (int64_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    return rows * (qkv + (int64_t)m->num_heads * m->head_dim) +
           attention_floats(m, rows, max_len, threads);
}

/* Layer `layer` from its q|k|v product to the input of o: qkv [rows, (NH + 2 NKV) D] in the
 * products' dtype -> q and k rotated, every row's K/V written at its slot, then attention over
 * the paged cache -> out [rows, NH D] in the products' dtype. Row r: the token at positions[r]
 * of the request whose block table is row r of block_table, attending positions 0 ..
 * positions[r] (seq_lens[r] = positions[r] + 1); a request's earlier tokens in this step come
 * before it. scratch: bw_attend_qkv_floats for the longest seq_len. Returns 0, or -1 when the
 * rows do not fit (rows_fit). */
int bw_attend_qkv(const model_t *m, int layer, int rows, const void *qkv, const int64_t *positions,
                  const int32_t *block_table, int table_width, const int32_t *seq_lens, void *out,
                  int bf16, float *scratch, int threads) {
    if (rows < 1 || layer < 0 || layer >= m->num_layers ||
        !rows_fit(m, rows, positions, table_width, seq_lens))
        return -1;
    const layer_t *l = &m->layers[layer];
    const int D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads;
    const int QKV = (NH + 2 * NKV) * D;
    float *q = scratch, *attended = q + (int64_t)rows * QKV;
    float *attention_scratch = attended + (int64_t)rows * NH * D;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            float *row = q + (int64_t)r * QKV;
            to_floats((const char *)qkv + (int64_t)r * QKV * (bf16 ? 2 : 4), bf16, QKV, row);
            write_row_kv(m, l, row, NULL, positions[r],  /* the product added its bias */
                         block_table + (int64_t)r * table_width);
        }
        attend_rows(m, l, rows, q, QKV, block_table, table_width, seq_lens, attended,
                    attention_scratch);
        #pragma omp for schedule(static)
        for (int r = 0; r < rows; r++)
            from_floats(attended + (int64_t)r * NH * D, (int64_t)NH * D, bf16,
                        (char *)out + (int64_t)r * NH * D * (bf16 ? 2 : 4));
    }
    return 0;
}

/* out [rows, I] = silu(gate) * up from gate|up [rows, 2 I], both in the products' dtype; in
 * pieces of SILU_PIECE features, so that no buffer grows with the model. */
#define SILU_PIECE 256
int bw_silu_mul(const model_t *m, int rows, const void *gate_up, void *out, int bf16,
                int threads) {
    const int I = m->intermediate, size = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const char *gate = (const char *)gate_up + (int64_t)r * 2 * I * size;
        for (int at = 0; at < I; at += SILU_PIECE) {
            const int n = I - at < SILU_PIECE ? I - at : SILU_PIECE;
            float g[SILU_PIECE], u[SILU_PIECE];
            to_floats(gate + (int64_t)at * size, bf16, n, g);
            to_floats(gate + ((int64_t)I + at) * size, bf16, n, u);
            silu_mul(n, g, u, g);
            from_floats(g, n, bf16, (char *)out + ((int64_t)r * I + at) * size);
        }
    }
    return 0;
}

/* What a layer does to each decode row between its products: the norm, rotary and the K/V
 * write, SiLU times up. Shared by the whole native step (decode.c) and the calls between torch's
 * products for steps of more rows (between.h). Included once, by decode.c. */
#pragma once

#include "common.h"

/* out = rms_norm(x) * weight, in float32 (torch's rms_norm: x * rsqrt(mean(x^2) + eps)). */
static void rms_norm(int n, const float *x, const float *weight, float eps, float *out) {
    float ss = 0.f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * weight[i];
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

/* Whether rows of one token each fit the step: context lengths within the model's and the
 * block table's, each row's position the last of its context. */
static int rows_fit(const model_t *m, int rows, const int64_t *positions,
                           int table_width, const int32_t *seq_lens) {
    for (int r = 0; r < rows; r++)
        if (seq_lens[r] < 1 || seq_lens[r] > m->max_seq_len || positions[r] != seq_lens[r] - 1 ||
            (seq_lens[r] - 1) / m->block_size >= table_width)
            return 0;
    return 1;
}

/* Row `row` of q|k|v (float32, the qkv product's output; bias: added first, or NULL) at
 * `position`: q and k heads rotated in place, k and v written to the layer's cache at the slot
 * the row's block table gives. */
static void write_row_kv(const model_t *m, const layer_t *l, float *row, const float *bias,
                         int64_t position, const int32_t *blocks) {
    const int D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads;
    if (bias) for (int i = 0; i < (NH + 2 * NKV) * D; i++) row[i] += bias[i];
    const float *cs = m->cos_sin + position * D;
    for (int hd = 0; hd < NH + NKV; hd++) rotate(row + hd * D, cs, D);
    const int64_t slot = (int64_t)blocks[position / m->block_size] * m->block_size +
                         position % m->block_size;
    for (int g = 0; g < NKV; g++) {
        write_cache(m, l->k_cache, g, slot, row + (NH + g) * D);
        write_cache(m, l->v_cache, g, slot, row + (NH + NKV + g) * D);
    }
}

/* out[i] = silu(gate[i]) * up[i] (out may be gate). */
static void silu_mul(int n, const float *gate, const float *up, float *out) {
    for (int i = 0; i < n; i++) out[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];
}

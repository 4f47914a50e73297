/* The LM head's logits for steps of more rows than one native call takes (decoder.py's
 * NativeDecoder.logits). There torch's bfloat16 GEMM computes every logit, fast, but hands them
 * back in bfloat16, its output type: at a logit of 16 that is a step of 0.125, wide enough to
 * reorder near-ties of the top tokens (on the repository's quality text this rounding alone
 * cost 2 points of top-1 agreement with the float32 reference, more than every other bfloat16
 * rounding of the step together). So each row's `top` largest logits are computed again from
 * the stored head (its values as stored, times the float32 hidden state, summed in float32),
 * and the others are widened as they are. Included once, by decode.c. */
#pragma once

#include "common.h"

#define MAX_TOP 16

/* w[n, :] . x in float32, from the stored codes of row n (the tiled layout of decode.c). */
static float stored_row_dot(const qmat *w, int64_t n, const float *x) {
    const int groups = w->k / GROUP, four = w->bits == 4, j = (int)(n % ROW_TILE);
    const int64_t t = n / ROW_TILE, group_bytes = four ? 64 : 128;
    float total = 0.f;
    for (int g = 0; g < groups; g++) {
        const uint8_t *q = w->q + (t * groups + g) * group_bytes + 16 * j;
        const float *xg = x + (int64_t)g * GROUP;
        float dot = 0.f, sum = 0.f;
        for (int i = 0; i < 16; i++) {
            const int first = four ? q[i] & 15 : q[i], second = four ? q[i] >> 4 : q[64 + i];
            dot += (float)first * xg[i] + (float)second * xg[i + 16];
            sum += xg[i] + xg[i + 16];
        }
        const int64_t at = (t * groups + g) * ROW_TILE + j;
        const float scale = half_to_float(w->scale[at]);
        const float bias = four ? half_to_float(w->bias[at]) : -128.f * scale;
        total += scale * dot + bias * sum;
    }
    return total;
}

/* logits [rows, vocab] float32 from rough [rows, vocab] (bfloat16, torch's GEMM of h): each
 * row widened, and its `top` largest (1..MAX_TOP) computed again from the stored head and
 * h [rows, hidden] (float32). Returns 0, or -1 when `top` is out of range. */
int bw_head_logits(const model_t *m, int rows, const float *h, const uint16_t *rough,
                   float *logits, int top, int threads) {
    const qmat *w = &m->lm_head;
    if (top < 1 || top > MAX_TOP || top > w->n) return -1;
    const int64_t vocab = w->n;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const uint16_t *in = rough + (int64_t)r * vocab;
        float *out = logits + (int64_t)r * vocab;
        int64_t best[MAX_TOP];
        float best_value[MAX_TOP];
        int kept = 0, lowest = 0;  /* the kept candidate that the next one would replace */
        float bar = -INFINITY;  /* the lowest kept value, once `top` are kept */
        for (int64_t v = 0; v < vocab; v += 16) {
            const int n = vocab - v < 16 ? (int)(vocab - v) : 16;
            if (n == 16) {  /* widen 16; look at each only when one of them beats the bar */
                const f32x16 values = bf16x16(in + v);
                store16(out + v, values);
                if (hmax(values) <= bar) continue;
            } else {
                for (int i = 0; i < n; i++) {
                    const uint32_t bits = (uint32_t)in[v + i] << 16;
                    memcpy(out + v + i, &bits, 4);
                }
            }
            for (int i = 0; i < n; i++) {
                const float value = out[v + i];
                if (kept < top) {
                    best[kept] = v + i;
                    best_value[kept++] = value;
                } else if (value > bar) {
                    best[lowest] = v + i;
                    best_value[lowest] = value;
                } else {
                    continue;
                }
                for (int j = 0; j < kept; j++)
                    if (best_value[j] < best_value[lowest]) lowest = j;
                if (kept == top) bar = best_value[lowest];
            }
        }
        for (int i = 0; i < kept; i++)
            out[best[i]] = stored_row_dot(w, best[i], h + (int64_t)r * w->k);
    }
    return 0;
}

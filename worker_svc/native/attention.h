/* Attention of decode rows over the paged KV cache, read in place: work items of (row, KV
 * head, chunk of positions), joined per head as in flash-decoding. Included once, by
 * decode.c. */
#pragma once

#include "common.h"

#define CHUNK 128          /* positions per attention work item: items enough for every thread */
#define MAX_HEAD_DIM 256

/* Row j of a K or V cache block as floats; V = head_dim / 16. */
static inline __attribute__((always_inline)) void cache_floats(const model_t *m, const void *block,
                                                               int j, const int V, f32x16 *out) {
    for (int i = 0; i < V; i++)
        out[i] = m->cache_bf16 ? bf16x16((const uint16_t *)block + (int64_t)j * 16 * V + 16 * i)
                               : load16((const float *)block + (int64_t)j * 16 * V + 16 * i);
}

/* Block `block` of kv_head's cache fetched ahead into the caches: a row's blocks lie anywhere
 * in the cache, where the hardware's prefetchers (which follow addresses within a page) find
 * each one only after a few misses; without this a 64-row step read its K/V at a fifth of the
 * memory's bandwidth. */
static inline void prefetch_block(const model_t *m, const void *cache, int kv_head, int block) {
    const int64_t bytes = (int64_t)m->block_size * m->head_dim * (m->cache_bf16 ? 2 : 4);
    const char *at = (const char *)cache + ((int64_t)kv_head * m->num_blocks + block) * bytes;
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(at + byte);
}

/* Where position t of a row's context starts its run of consecutive cache rows: the block
 * holding it (head-major storage: its rows are contiguous), t's row in it, and the run's
 * length up to `end`; the run's next block is fetched ahead. One division per block rather
 * than per position. */
static inline const void *cache_run(const model_t *m, const void *cache, int kv_head,
                                    const int32_t *blocks, int t, int end, int *first, int *run) {
    const int b = t / m->block_size;
    *first = t - b * m->block_size;
    *run = m->block_size - *first < end - t ? m->block_size - *first : end - t;
    if (t + *run < end) prefetch_block(m, cache, kv_head, blocks[b + 1]);
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
    prefetch_block(m, l->v_cache, kv_head, blocks[t0 / m->block_size]);  /* for the V pass */
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

/* Floats of scratch attend_rows takes for `rows` rows whose contexts are at most max_len long,
 * and `threads` threads: each head's part of each chunk, and each thread's scores. */
static int64_t attention_floats(const model_t *m, int rows, int max_len, int threads) {
    const int64_t chunks = (max_len + CHUNK - 1) / CHUNK;
    return rows * (int64_t)m->num_heads * chunks * (2 + m->head_dim) +
           (int64_t)threads * m->num_heads * CHUNK;
}

/* Attention of `rows` query rows of layer l, inside the caller's OpenMP team: row r's query
 * heads at q + r * q_stride (rotated; its K/V already in the cache), attending the first
 * seq_lens[r] positions of its context (a decode row all of it; a prompt token those up to its
 * own), its output heads at out + r * num_heads * head_dim. Work items are (row, KV head, chunk
 * of CHUNK positions), so that even one row's context is shared among the threads; then each
 * head's chunks join. scratch: attention_floats for the longest of seq_lens. */
static void attend_rows(const model_t *m, const layer_t *l, int rows, const float *q,
                        int64_t q_stride, const int32_t *block_table, int table_width,
                        const int32_t *seq_lens, float *out, float *scratch) {
    const int D = m->head_dim, NH = m->num_heads, NKV = m->num_kv_heads, group = NH / NKV;
    int step_chunks = 0;  /* the most chunks of any row this step */
    for (int r = 0; r < rows; r++)
        if ((seq_lens[r] + CHUNK - 1) / CHUNK > step_chunks)
            step_chunks = (seq_lens[r] + CHUNK - 1) / CHUNK;
    const int64_t part_size = 2 + D;  /* one head's part of one chunk */
    float *parts = scratch;           /* [rows, NKV, step_chunks, group, part_size] */
    float *scores = parts + rows * (int64_t)NH * step_chunks * part_size;  /* [threads, group,
                                                                              CHUNK] */
    #pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < rows * NKV * step_chunks; item++) {
        const int c = item % step_chunks, kv_head = item / step_chunks % NKV;
        const int r = item / (step_chunks * NKV), t0 = c * CHUNK;
        if (t0 >= seq_lens[r]) continue;
        const int t1 = t0 + CHUNK < seq_lens[r] ? t0 + CHUNK : seq_lens[r];
        attend_chunk(m, l, block_table + (int64_t)r * table_width, t0, t1,
                     q + r * q_stride + kv_head * group * D, kv_head, group,
                     scores + (int64_t)omp_get_thread_num() * group * CHUNK,
                     parts + (((int64_t)r * NKV + kv_head) * step_chunks + c) * group * part_size);
    }
    #pragma omp for schedule(static)
    for (int item = 0; item < rows * NH; item++) {
        const int r = item / NH, head = item % NH, kv_head = head / group;
        combine_chunks((seq_lens[r] + CHUNK - 1) / CHUNK, D,
                       parts + ((int64_t)r * NKV + kv_head) * step_chunks * group * part_size +
                           (head % group) * part_size,
                       group * part_size, out + (int64_t)r * NH * D + head * D);
    }
}

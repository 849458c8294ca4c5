/* Split-K decoding (flash-decoding) for the decode kernel: how many parts a work item's keys are
 * split into when a step has too few items for the threads, and the parts' merge. */
#ifndef KILN_PAGED_ATTENTION_SPLIT_H
#define KILN_PAGED_ATTENTION_SPLIT_H

#include <math.h>
#include <stdint.h>

#include "paged_attention_rows.h"

/* Decodes whose work items are fewer than twice the threads (one request's few kv heads: 3 over
 * 2 threads left one with twice the work) split each item's keys into parts of at least this
 * many, computed apart and merged by their softmax maxima. */
#define SPLIT_MIN_KEYS 128

/* How many parts each item's keys are split into (1: none). */
static int key_parts(int64_t items, int num_threads, int max_seq_len, const int32_t *reqs,
                     int num_sel, const int32_t *query_start) {
    if (items >= 2 * num_threads || max_seq_len < 2 * SPLIT_MIN_KEYS) return 1;
    for (int i = 0; i < num_sel; ++i)
        if (query_start[reqs[i] + 1] - query_start[reqs[i]] != 1) return 1; /* decodes only */
    const int64_t want = (2 * num_threads + items - 1) / items, most = max_seq_len / SPLIT_MIN_KEYS;
    return (int)(want < most ? want : most);
}

/* One item's `parts` results (each [rows, hd] unnormalized outputs, then rows sums, then rows
 * maxima; a part with a zero sum is empty) merged, each weighed by e^(its maximum - the largest),
 * and stored as the item's rows of out from element o_off on, times v_scale; acc: hd floats. */
static void merge_parts(const float *first, int parts, size_t rows, int hd, float *acc, void *out,
                        int64_t o_off, float v_scale, int dtype) {
    const size_t unit_floats = rows * ((size_t)hd + 2);
    for (size_t i = 0; i < rows; ++i) {
        float m = -INFINITY, sum = 0.f;
        for (int p = 0; p < parts; ++p) {
            const float *u = first + p * unit_floats;
            if (u[rows * hd + i] > 0.f && u[rows * hd + rows + i] > m) m = u[rows * hd + rows + i];
        }
        for (int d = 0; d < hd; ++d) acc[d] = 0.f;
        for (int p = 0; p < parts; ++p) {
            const float *u = first + p * unit_floats;
            if (u[rows * hd + i] == 0.f) continue; /* an empty part */
            const float w = expf(u[rows * hd + rows + i] - m);
            sum += w * u[rows * hd + i];
            for (int d = 0; d < hd; ++d) acc[d] += w * u[i * hd + d];
        }
        store_row(out, o_off + (int64_t)i * hd, acc, v_scale / sum, hd, dtype);
    }
}

#endif

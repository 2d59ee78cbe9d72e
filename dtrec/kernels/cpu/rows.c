/* dtrec's CPU row kernels: the row-sparse backward and the row-wise updates, in C.
 *
 * Plain pointers in, one thread, no allocation of their own (the caller passes every
 * buffer). Built by dtrec/kernels/cpu/__init__.py with -ffp-contract=off, so each
 * floating-point operation rounds as torch's own ops round it (no fused multiply-add).
 *
 * Layout: row-major fp32 matrices; `ld` is a matrix's row stride in elements.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define DIGIT_BITS 11
#define BUCKETS (1 << DIGIT_BITS)

/* Stable LSD radix sort of n keys in [0, 2^32) by key: `pairs` holds key << 32 | i,
 * `scratch` n more slots. The sorted pairs end in `pairs`. key_bits: bits to sort. */
static void radix_sort_pairs(uint64_t *pairs, uint64_t *scratch, int64_t n, int key_bits) {
    int64_t count[BUCKETS];
    uint64_t *src = pairs, *dst = scratch;
    for (int shift = 32; shift < 32 + key_bits; shift += DIGIT_BITS) {
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++) count[(src[i] >> shift) & (BUCKETS - 1)]++;
        int64_t total = 0;
        for (int b = 0; b < BUCKETS; b++) {
            int64_t c = count[b];
            count[b] = total;
            total += c;
        }
        for (int64_t i = 0; i < n; i++) dst[count[(src[i] >> shift) & (BUCKETS - 1)]++] = src[i];
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != pairs) memcpy(pairs, src, (size_t)n * sizeof(uint64_t));
}

/* Sort the occurrences of n keys (each in [0, key_bound), key_bound <= 2^32, n < 2^32)
 * stably by key into `pairs` (2n slots: the second half is scratch). Returns the number
 * of distinct keys, or -1 for a key outside [0, key_bound). */
int64_t dtrec_sort_keys(const int64_t *keys, int64_t n, int64_t key_bound, uint64_t *pairs) {
    for (int64_t i = 0; i < n; i++) {
        int64_t k = keys[i];
        if (k < 0 || k >= key_bound) return -1;
        pairs[i] = ((uint64_t)k << 32) | (uint64_t)i;
    }
    int key_bits = 0;
    while (key_bits < 32 && ((int64_t)1 << key_bits) < key_bound) key_bits++;
    radix_sort_pairs(pairs, pairs + n, n, key_bits);
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || (pairs[i] >> 32) != (pairs[i - 1] >> 32)) distinct++;
    return distinct;
}

/* The row-sparse backward's occurrences, built from the bags and sorted in one call: for
 * each of the m entries entries[j] (bags e * batch .. e * batch + batch - 1 of `offsets`),
 * each id v of its bag b gets the key entry_base[e] + v and carries the row of its bag's
 * gradient, row_start[j] + b * row_stride[j], as the pair key << 32 | row. `pairs` (2n
 * slots, n = the entries' ids; the second half is scratch) ends sorted stably by key, so
 * dtrec_sum_sorted(index NULL, scale NULL) sums each key's rows in occurrence order: what
 * dtrec_sort_keys does for keys and an index made by repeating per-bag values, without
 * them. Returns the number of distinct keys, -1 for a key outside [0, key_bound), -2 for
 * bags outside the num_values values or not holding n ids. */
int64_t dtrec_sort_bag_rows(const int64_t *values, const int64_t *offsets, int64_t batch,
                            int64_t m, const int64_t *entries, const int64_t *entry_base,
                            const int64_t *row_start, const int64_t *row_stride,
                            int64_t key_bound, int64_t num_values, int64_t n,
                            uint64_t *pairs) {
    int64_t total = 0; /* the bags must lie in values and hold n ids (pairs' capacity) */
    for (int64_t j = 0; j < m; j++) {
        for (int64_t b = entries[j] * batch; b < (entries[j] + 1) * batch; b++) {
            if (offsets[b] < 0 || offsets[b + 1] > num_values || offsets[b + 1] < offsets[b])
                return -2;
            total += offsets[b + 1] - offsets[b];
        }
    }
    if (total != n) return -2;
    n = 0;
    for (int64_t j = 0; j < m; j++) {
        int64_t e = entries[j], base = entry_base[e];
        for (int64_t b = 0; b < batch; b++) {
            uint64_t row = (uint64_t)(row_start[j] + b * row_stride[j]);
            for (int64_t i = offsets[e * batch + b]; i < offsets[e * batch + b + 1]; i++) {
                int64_t k = base + values[i];
                if (k < 0 || k >= key_bound) return -1;
                pairs[n++] = ((uint64_t)k << 32) | row;
            }
        }
    }
    int key_bits = 0;
    while (key_bits < 32 && ((int64_t)1 << key_bits) < key_bound) key_bits++;
    radix_sort_pairs(pairs, pairs + n, n, key_bits);
    int64_t distinct = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || (pairs[i] >> 32) != (pairs[i - 1] >> 32)) distinct++;
    return distinct;
}

/* Per distinct key of the sorted `pairs` (dtrec_sort_keys), in key order: unique[u] = the
 * key, sums[u, :] = sum over its occurrences i, in their original order, of
 * rows[index[i], :] * scale[i] (index NULL: row i; scale NULL: 1). */
void dtrec_sum_sorted(const uint64_t *pairs, int64_t n, const int64_t *index, const float *scale,
                      const float *restrict rows, int64_t ld_rows, int64_t dim,
                      int64_t *restrict unique, float *restrict sums) {
    int64_t u = -1;
    float *restrict out = sums;
    for (int64_t i = 0; i < n; i++) {
        uint64_t key = pairs[i] >> 32;
        int64_t at = (int64_t)(pairs[i] & 0xffffffffu);
        if (i == 0 || key != (pairs[i - 1] >> 32)) {
            u++;
            unique[u] = (int64_t)key;
            out = sums + u * dim;
            memset(out, 0, (size_t)dim * sizeof(float));
        }
        if (i + 8 < n) { /* the row 8 occurrences ahead: its loads overlap this row's sums */
            int64_t ahead = (int64_t)(pairs[i + 8] & 0xffffffffu);
            const char *p = (const char *)(rows + (index ? index[ahead] : ahead) * ld_rows);
            for (int64_t b = 0; b < dim * (int64_t)sizeof(float); b += 64) __builtin_prefetch(p + b);
        }
        const float *restrict row = rows + (index ? index[at] : at) * ld_rows;
        if (scale) {
            float s = scale[at];
            for (int64_t d = 0; d < dim; d++) out[d] += row[d] * s;
        } else {
            for (int64_t d = 0; d < dim; d++) out[d] += row[d];
        }
    }
}

/* Whether every index[i] lies in [0, bound). */
int64_t dtrec_indices_within(const int64_t *index, int64_t n, int64_t bound) {
    for (int64_t i = 0; i < n; i++)
        if (index[i] < 0 || index[i] >= bound) return 0;
    return 1;
}

/* sq[u] = sum_d grads[u, d]^2, summed in order of d. */
void dtrec_row_sq_sums(const float *grads, int64_t num, int64_t dim, float *sq) {
    for (int64_t u = 0; u < num; u++) {
        const float *g = grads + u * dim;
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++) s += g[d] * g[d];
        sq[u] = s;
    }
}

/* Rows are scattered over tables larger than the caches: ask for row u's lines (and its
 * accumulator) PREFETCH rows ahead, so the memory system fetches several rows at once. */
#define PREFETCH 16
#define AHEAD 192
static inline void prefetch_row(float *weight, float *acc, int64_t ld_w, int64_t dim,
                                const int64_t *rows, int64_t u, int64_t num) {
    if (u >= num) return;
    const char *p = (const char *)(weight + rows[u] * ld_w);
    for (int64_t b = 0; b < dim * (int64_t)sizeof(float); b += 64) __builtin_prefetch(p + b, 1);
    if (acc) __builtin_prefetch(acc + rows[u], 1);
}

/* One touched row's exact row-wise Adagrad step, in place: acc += sum_d g^2 / full_dim
 * (sq < 0: summed here, in order of d); w += g * (-lr / (sqrt(acc) + eps)). */
static inline void adagrad_row(float *restrict w, float *restrict acc, const float *restrict g,
                               int64_t dim, float sq, float full_dim, float lr, float eps) {
    if (sq < 0.0f) {
        sq = 0.0f;
        for (int64_t d = 0; d < dim; d++) sq += g[d] * g[d];
    }
    float a = *acc + sq / full_dim;
    *acc = a;
    float mult = (1.0f / (sqrtf(a) + eps)) * -lr; /* as torch's `-lr / t`: 1 / t, times */
    for (int64_t d = 0; d < dim; d++) w[d] += g[d] * mult;
}

/* Exact row-wise Adagrad on the distinct rows `rows[u]` of `weight`, in place:
 * acc[r] += sq[u] / full_dim; w[r, :] += g[u, :] * (-lr / (sqrt(acc[r]) + eps)).
 * sq NULL: each row's own sum of squares (dtrec_row_sq_sums). */
void dtrec_rowwise_adagrad(float *restrict weight, int64_t ld_w, float *restrict acc,
                           const int64_t *rows, int64_t num, const float *restrict grads,
                           int64_t dim, const float *restrict sq, int64_t full_dim, float lr,
                           float eps) {
    float fd = (float)(full_dim > 1 ? full_dim : 1);
    for (int64_t u = 0; u < num; u++) {
        prefetch_row(weight, acc, ld_w, dim, rows, u + PREFETCH, num);
        int64_t r = rows[u];
        adagrad_row(weight + r * ld_w, acc + r, grads + u * dim, dim, sq ? sq[u] : -1.0f, fd, lr,
                    eps);
    }
}

/* SGD on the distinct rows `rows[u]` of `weight`, in place: w[r, :] += g[u, :] * -lr. */
void dtrec_sgd(float *restrict weight, int64_t ld_w, const int64_t *rows, int64_t num,
               const float *restrict grads, int64_t dim, float lr) {
    for (int64_t u = 0; u < num; u++) {
        const float *g = grads + u * dim;
        prefetch_row(weight, NULL, ld_w, dim, rows, u + PREFETCH, num);
        float *restrict w = weight + rows[u] * ld_w;
        for (int64_t d = 0; d < dim; d++) w[d] += g[d] * -lr;
    }
}

/* A pooled lookup's backward and one step on its tables, fused: no row gradient is stored.
 *
 * Entry e reads table entry_table[e] (dim[t] columns at entry_col[e] of grad_out's rows;
 * bag e * batch + b is values[offsets[e*batch + b] : offsets[e*batch + b + 1]]). Each
 * occurrence i of id v in bag b of entry e contributes grad_out[b, entry_col[e] + :] *
 * grad_scale * s_i (s_i: 1 / len(bag) for a mean entry, times psw[i] if given) to row v
 * of its table. Occurrences are summed per touched row in their original order (a stable
 * radix sort of the keys row_base[t] + v), then the row is stepped: rule 0 SGD, 1 exact
 * row-wise Adagrad (acc_ptrs[t]: the table's accumulators, full_dim = dim[t]).
 *
 * weight_ptrs / acc_ptrs: each table's first element's address (rows contiguous, row
 * stride dim[t]). pairs: 2n scratch slots; bag_of: n; rowbuf: max dim floats.
 * Returns 0, or (nothing written) -1 for an id outside its table, -2 for a key space of
 * 2^32 rows or more, -3 for offsets that are not a non-decreasing run within the ids. */
int64_t dtrec_backward_update(const int64_t *restrict values, int64_t n,
                              const int64_t *restrict offsets, int64_t num_entries, int64_t batch,
                              const int64_t *restrict entry_table,
                              const int64_t *restrict entry_col,
                              const uint8_t *restrict entry_mean, int64_t num_tables,
                              const int64_t *restrict table_rows, const int64_t *restrict dim,
                              const int64_t *restrict weight_ptrs,
                              const int64_t *restrict acc_ptrs, const float *restrict grad_out,
                              int64_t ld_grad, const float *restrict psw, float grad_scale,
                              int64_t rule, float lr, float eps, uint64_t *restrict pairs,
                              int32_t *restrict bag_of, int64_t *restrict row_base,
                              float *restrict rowbuf) {
    row_base[0] = 0;
    for (int64_t t = 0; t < num_tables; t++) row_base[t + 1] = row_base[t] + table_rows[t];
    if (row_base[num_tables] > (int64_t)0xffffffff || n > (int64_t)0x7fffffff) return -2;
    if (offsets[0] < 0 || offsets[num_entries * batch] > n) return -3;
    for (int64_t b = 0; b < num_entries * batch; b++)
        if (offsets[b + 1] < offsets[b]) return -3;
    int any_mean = 0;
    for (int64_t e = 0; e < num_entries; e++) any_mean |= entry_mean[e];
    /* Sum pooling without weights (the common case): an occurrence needs only its bag's
     * gradient row, so the pair carries that row's offset in grad_out (not the id's
     * position): the summing pass reads it straight, with no bag_of load or division. */
    int plain = !any_mean && !psw && batch * ld_grad <= (int64_t)0xffffffff;
    for (int64_t b = 0; b < num_entries * batch; b++) {
        int64_t e = b / batch, t = entry_table[e];
        uint64_t grad_at = (uint64_t)((b - e * batch) * ld_grad + entry_col[e]);
        for (int64_t i = offsets[b]; i < offsets[b + 1]; i++) {
            int64_t v = values[i];
            if (v < 0 || v >= table_rows[t]) return -1;
            if (plain) {
                pairs[i] = ((uint64_t)(row_base[t] + v) << 32) | grad_at;
            } else {
                bag_of[i] = (int32_t)b;
                pairs[i] = ((uint64_t)(row_base[t] + v) << 32) | (uint64_t)i;
            }
        }
    }
    int key_bits = 0;
    while (key_bits < 32 && ((int64_t)1 << key_bits) < row_base[num_tables]) key_bits++;
    radix_sort_pairs(pairs, pairs + n, n, key_bits);
    int64_t t = 0;
    for (int64_t i = 0; i < n;) {
        uint64_t key = pairs[i] >> 32;
        while ((int64_t)key >= row_base[t + 1]) t++;
        int64_t D = dim[t], r = (int64_t)key - row_base[t];
        if (i + AHEAD < n) { /* the row touched about AHEAD occurrences on: its lines load
                              * while this run sums (tables are larger than the caches) */
            int64_t ahead = (int64_t)(pairs[i + AHEAD] >> 32), ta = t;
            while (ahead >= row_base[ta + 1]) ta++;
            const char *p = (const char *)((float *)(intptr_t)weight_ptrs[ta] +
                                           (ahead - row_base[ta]) * dim[ta]);
            for (int64_t c = 0; c < dim[ta] * (int64_t)sizeof(float); c += 64)
                __builtin_prefetch(p + c, 1);
            if (rule == 1)
                __builtin_prefetch((float *)(intptr_t)acc_ptrs[ta] + (ahead - row_base[ta]), 1);
        }
        memset(rowbuf, 0, (size_t)D * sizeof(float));
        int64_t j = i;
        if (plain && grad_scale == 1.0f) { /* g * 1 is g: the same sums without the multiply */
            for (; j < n && (pairs[j] >> 32) == key; j++) {
                const float *restrict g = grad_out + (pairs[j] & 0xffffffffu);
                for (int64_t d = 0; d < D; d++) rowbuf[d] += g[d];
            }
        } else if (plain) {
            for (; j < n && (pairs[j] >> 32) == key; j++) {
                const float *restrict g = grad_out + (pairs[j] & 0xffffffffu);
                for (int64_t d = 0; d < D; d++) rowbuf[d] += g[d] * grad_scale;
            }
        }
        for (; j < n && (pairs[j] >> 32) == key; j++) {
            int64_t at = (int64_t)(pairs[j] & 0xffffffffu), b = bag_of[at];
            int64_t e = b / batch;
            const float *restrict g = grad_out + (b - e * batch) * ld_grad + entry_col[e];
            if (!any_mean && !psw) {
                for (int64_t d = 0; d < D; d++) rowbuf[d] += g[d] * grad_scale;
                continue;
            }
            float s = 1.0f;
            if (entry_mean[e]) {
                int64_t len = offsets[b + 1] - offsets[b];
                s = 1.0f / (float)(len > 1 ? len : 1);
            }
            if (psw) s = s * psw[at];
            for (int64_t d = 0; d < D; d++) rowbuf[d] += (g[d] * grad_scale) * s;
        }
        float *restrict w = (float *)(intptr_t)weight_ptrs[t] + r * D;
        if (rule == 1) {
            float *acc = (float *)(intptr_t)acc_ptrs[t] + r;
            adagrad_row(w, acc, rowbuf, D, -1.0f, (float)(D > 1 ? D : 1), lr, eps);
        } else {
            for (int64_t d = 0; d < D; d++) w[d] += rowbuf[d] * -lr;
        }
        i = j;
    }
    return 0;
}

/* Managed collision's remap through dtrec.modules.remap_index.HashRemapIndex: per id, its
 * home slot (the top `bits` bits of id * the index's multiplier, an arithmetic shift made
 * non-negative by adding half the slots), then linear probing until the id (its row) or
 * an empty slot (miss_row), at most `probes` slots. Homes of a block of ids are computed
 * and prefetched before any is probed: the reads of a block overlap. */
void dtrec_remap_lookup(const int64_t *restrict slot_ids, const int64_t *restrict slot_rows,
                        int64_t bits, int64_t probes, const int64_t *restrict values, int64_t n,
                        int64_t miss_row, int64_t *restrict out) {
    const uint64_t mult = 0xC4CEB9FE1A85EC53ull;
    const int64_t half = (int64_t)1 << (bits - 1), empty = INT64_MAX;
    enum { BLOCK = 16 };
    int64_t home[BLOCK];
    for (int64_t start = 0; start < n; start += BLOCK) {
        int64_t m = n - start < BLOCK ? n - start : BLOCK;
        for (int64_t k = 0; k < m; k++) {
            home[k] = ((int64_t)((uint64_t)values[start + k] * mult) >> (64 - bits)) + half;
            __builtin_prefetch(slot_ids + home[k]);
        }
        for (int64_t k = 0; k < m; k++) {
            int64_t v = values[start + k], row = miss_row;
            for (int64_t p = 0; p < probes; p++) {
                int64_t id = slot_ids[home[k] + p];
                if (id == v) {
                    row = slot_rows[home[k] + p];
                    break;
                }
                if (id == empty) break;
            }
            out[start + k] = row;
        }
    }
}

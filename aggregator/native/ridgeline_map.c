/* The per-kernel passes of a batch's phase mapping (aggregator/stream_phases.py,
 * StreamPhaser.map_batch), built into libridgeline_fold.so with ridgeline_fold.c.
 *
 * map_batch took about ten numpy passes over a batch's kernels (the (step, start) order
 * check, the kept-kernel mask and its compaction, the step runs, each kernel's position in
 * its run, the shape hash, the gather of the remembered phases and their scatter); these two
 * functions do the same in two passes. Their numpy reference is map_batch itself with
 * fold_native.REFERENCE set (tests/test_stream_map_native.py checks both give the same
 * BatchPhases and the same wire-encoded windows).
 *
 * No allocation, no global state: the caller (numpy) owns every buffer; thread-safe.
 */
#include <stddef.h>
#include <stdint.h>

#include "ridgeline_records.h"

#define EXPORT __attribute__((visibility("default")))


/* The steps map_batch decides, as runs of kernels, with each run's shape hash.
 *
 * Kernels: n records at base (stride bytes apart); off: byte offsets of start_ns (int64),
 * then name_id, grid_x, grid_y, block_x, grid_z, block_y (int32), the hash's fields. step: int32 per kernel (segment_kernels' kernel_step, -1: none).
 * order: NULL to take the kernels in batch order, which must then be map_batch's
 * (step << 40 | min(start - earliest start, 2**40 - 1)) order (key_order's test):
 * returns -1, writing nothing, when it is not (the caller sorts and calls again with its
 * order). Else n indices of the kernels in that order.
 *
 * A kernel is kept when its step is >= 0 and skip (NULL: none skipped; else one byte per
 * step) is 0 for it. Written: out_order[0:kept] the kept kernels' indices in order;
 * per run r (consecutive kept kernels of one step): out_first[r] its first position in
 * out_order, out_step[r] its step, out_hash[r] the step-shape hash over its kernels (c: C0..C5
 * and MUL): per kernel v = (name_id + 1) * C0 + grid_x * C1 + grid_y * C2 + block_x * C3 +
 * grid_z * C4 + block_y * C5 (uint64, wrapping; the int32 fields sign-extended), per run the
 * sum of v * MUL**position, xor its length * MUL (StreamPhaser._hashes_reference in
 * aggregator/stream_phases.py is the numpy reference). out_n[0] = kept. Returns the number of runs. */
/* The kernels in batch order are in that key order. */
static int key_order(const char *base, int64_t stride, int64_t off_start, int64_t n, const int32_t *step) {
    const int64_t cap = ((int64_t)1 << 40) - 1;
    if (n < 2) return 1;
    int64_t t0 = rd64(base, stride, 0, off_start);
    for (int64_t i = 1; i < n; i++) {
        int64_t v = rd64(base, stride, i, off_start);
        if (v < t0) t0 = v;
    }
    int64_t prev = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t rel = rd64(base, stride, i, off_start) - t0;
        int64_t key = (int64_t)((uint64_t)(int64_t)step[i] << 40) | (rel < cap ? rel : cap);
        if (i && key < prev) return 0;
        prev = key;
    }
    return 1;
}

/* The runs and hashes in one pass; with check (batch order), also whether (step, start) is
 * in lexicographic order: -2 as soon as it is not, and the span of the starts in span[]. */
static int64_t runs_pass(const char *base, int64_t stride, const int64_t *off, const uint64_t *c, int64_t n,
                         const int32_t *step, const int64_t *order, const uint8_t *skip, int64_t n_skip,
                         int64_t *out_order, int64_t *out_first, int64_t *out_step, uint64_t *out_hash,
                         int64_t *out_n, int check, int64_t *span) {
    int64_t kept = 0, runs = 0, cur = -1;
    int64_t prev_s = 0, prev_t = 0, t_min = 0, t_max = 0;
    uint64_t h = 0, p = 1;
    for (int64_t q = 0; q < n; q++) {
        int64_t i = order ? order[q] : q;
        int64_t s = step[i];
        if (check) {
            int64_t t = rd64(base, stride, i, off[0]);
            if (q && (s < prev_s || (s == prev_s && t < prev_t))) return -2;
            if (!q || t < t_min) t_min = t;
            if (!q || t > t_max) t_max = t;
            prev_s = s;
            prev_t = t;
        }
        if (s < 0 || (skip && s < n_skip && skip[s])) continue;
        if (runs == 0 || s != cur) {
            if (runs) out_hash[runs - 1] = h ^ ((uint64_t)(kept - out_first[runs - 1]) * c[6]);
            out_first[runs] = kept;
            out_step[runs] = s;
            runs++;
            cur = s;
            h = 0;
            p = 1;
        }
        uint64_t v = (uint64_t)((int64_t)rd32(base, stride, i, off[1]) + 1) * c[0];
        for (int f = 1; f < 6; f++)
            v += (uint64_t)(int64_t)rd32(base, stride, i, off[f + 1]) * c[f];
        h += v * p;
        p *= c[6];
        out_order[kept++] = i;
    }
    if (runs) out_hash[runs - 1] = h ^ ((uint64_t)(kept - out_first[runs - 1]) * c[6]);
    out_n[0] = kept;
    span[0] = t_max - t_min;
    return runs;
}

EXPORT int64_t rl_map_runs(const char *base, int64_t stride, const int64_t *off, const uint64_t *c,
                           int64_t n, const int32_t *step, const int64_t *order, const uint8_t *skip,
                           int64_t n_skip, int64_t *out_order, int64_t *out_first, int64_t *out_step,
                           uint64_t *out_hash, int64_t *out_n) {
    int64_t span = 0;
    int64_t r = runs_pass(base, stride, off, c, n, step, order, skip, n_skip, out_order, out_first, out_step,
                          out_hash, out_n, !order, &span);
    /* (step, start) in lexicographic order is the key's order while every start lies less
     * than 2**40 ns after the earliest (the key caps the rest) and steps stay below 2**23
     * (past that the key's shift wraps): otherwise the key's own test decides. */
    const int64_t cap = ((int64_t)1 << 40) - 1;
    if (!order && (r == -2 || span >= cap || n >= ((int64_t)1 << 23))) {
        if (!key_order(base, stride, off[0], n, step)) return -1;
        if (r == -2)
            r = runs_pass(base, stride, off, c, n, step, NULL, skip, n_skip, out_order, out_first, out_step,
                          out_hash, out_n, 0, &span);
    }
    return r;
}

/* Each kept kernel's phase: the remembered shape's phase at its position in its run.
 * order: kept indices (rl_map_runs' out_order); first: n_runs run starts in it; shape: per
 * run, the shape's offset into flat (the shapes' per-kernel phases laid end to end); the run
 * of kernels order[first[r]:first[r + 1]] gets flat[shape[r]:...] in order. phase: one byte
 * per kernel of the batch (the others untouched). Nothing here reads the hashes: the caller
 * keys its shapes by (hash, length), so each run's shape holds exactly as many phases as the
 * run has kernels and the copy stays inside flat. */
EXPORT void rl_map_phases(int64_t kept, const int64_t *order, int64_t n_runs, const int64_t *first,
                          const int64_t *shape, const uint8_t *flat, uint8_t *phase) {
    for (int64_t r = 0; r < n_runs; r++) {
        int64_t a = first[r], b = r + 1 < n_runs ? first[r + 1] : kept;
        const uint8_t *src = flat + shape[r] - a;
        for (int64_t q = a; q < b; q++) phase[order[q]] = src[q];
    }
}

/* The step cut's columns of a batch in one pass (aggregator/steps.py, segment_kernels):
 * end_ns (int64 at off_end) of every record into out_end, and the least and greatest
 * device (int32 at off_device) into range[0], range[1]. n >= 1. */
EXPORT void rl_end_and_devices(const char *base, int64_t stride, int64_t off_end, int64_t off_device, int64_t n,
                               int64_t *out_end, int64_t *range) {
    int32_t lo = rd32(base, stride, 0, off_device), hi = lo;
    for (int64_t i = 0; i < n; i++) {
        int32_t d = rd32(base, stride, i, off_device);
        if (d < lo) lo = d;
        if (d > hi) hi = d;
        out_end[i] = rd64(base, stride, i, off_end);
    }
    range[0] = lo;
    range[1] = hi;
}

/* aggregator/steps.py _argmax_in_ranges: per range r, the first position of the greatest
 * of values[lo[r]:hi[r]] into out[r]. Returns 0, having written nothing reliable, when a
 * range is empty or leaves [0, n) (the caller then takes its numpy path, which says so). */
EXPORT int64_t rl_argmax_ranges(const int64_t *values, int64_t n, const int64_t *lo, const int64_t *hi,
                                int64_t n_ranges, int64_t *out) {
    for (int64_t r = 0; r < n_ranges; r++) {
        int64_t a = lo[r], b = hi[r];
        if (a < 0 || b > n || b <= a) return 0;
        int64_t best = a;
        for (int64_t q = a + 1; q < b; q++)
            if (values[q] > values[best]) best = q;
        out[r] = best;
    }
    return 1;
}

/* aggregator/steps.py (segment_kernels, a batch of several devices): the records of each
 * device, in one counting pass and one placing pass over the device field (int32 at
 * off_device): bounds[v - lo] .. bounds[v - lo + 1] delimit in out_idx the indices of the
 * records whose device is v, ascending (numpy's np.flatnonzero(device == v) for each v,
 * which was a pass over every record per device, after np.unique's sort for the devices).
 * lo, hi: the least and greatest device (rl_end_and_devices); bounds has hi - lo + 2 slots,
 * zeroed by the caller; out_idx NULL: the counts only (bounds[v - lo + 1] the records of
 * device v, no placing pass). Returns 0 when a device lies outside [lo, hi]. */
EXPORT int64_t rl_device_groups(const char *base, int64_t stride, int64_t off_device, int64_t n, int64_t lo,
                                int64_t hi, int64_t *bounds, int64_t *out_idx) {
    for (int64_t i = 0; i < n; i++) {
        int64_t d = rd32(base, stride, i, off_device);
        if (d < lo || d > hi) return 0;
        bounds[d - lo + 1]++;
    }
    if (!out_idx) return 1;
    for (int64_t v = 0; v <= hi - lo; v++) bounds[v + 1] += bounds[v];
    for (int64_t i = 0; i < n; i++) {
        int64_t d = rd32(base, stride, i, off_device) - lo;
        /* checked again: the slots are sized by the first pass's counts */
        if (d < 0 || d > hi - lo || bounds[d] >= n) return 0;
        out_idx[bounds[d]++] = i;
    }
    /* each bounds[v] now holds the end of group v: shift back to the starts */
    for (int64_t v = hi - lo + 1; v > 0; v--) bounds[v] = bounds[v - 1];
    bounds[0] = 0;
    return 1;
}

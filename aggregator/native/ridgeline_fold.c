/* The per-kernel pass of the per-phase fold (aggregator/phase_figures.py, fold_kernels),
 * in one pass over the kernels and one over the units, without a Python object per kernel.
 *
 * The Python function _fold_pass_reference in phase_figures.py is the reference: it computes
 * the same arrays with numpy, and tests/test_fold_native.py checks that both give the same
 * figures on the simulator's streams and on the shared traces replayed. The definitions
 * (units, merged runs, gaps, fine histogram bins, host cover of the gaps) are those of
 * phase_figures.py's module docstring.
 *
 * No allocation, no global state: the caller (numpy) owns every buffer; thread-safe.
 */
#include <stdint.h>
#include <string.h>

#include "ridgeline_records.h"

#define EXPORT __attribute__((visibility("default")))

/* Kept equal to phase_figures.py: SUB_BITS, FINE_BINS, the order of the first N_WRITTEN
 * INT_FIELDS (the ones written here; a row holds nf of them, the caller's count), H_* planes.
 * rl_fold_abi() returns them so that the loader refuses a library of another layout. */
#define SUB_BITS 3
#define FINE_BINS (48 << SUB_BITS)
enum { I_KERNELS, I_KERNEL_TIME, I_BUSY, I_STEPS, I_WINDOW, I_WINDOW_BUSY, I_GAPS, I_GAP_NS,
       I_GAP_LAUNCH, I_GAP_SYNC, I_LAUNCH_KERNELS, I_LAUNCH_LATENCY, N_WRITTEN };
enum { H_KERNEL, H_GAP, H_LAUNCH };

EXPORT int64_t rl_fold_abi(void) { return ((int64_t)SUB_BITS << 32) | ((int64_t)FINE_BINS << 8) | N_WRITTEN; }

/* phase_figures.fine_bins: octave and the top SUB_BITS mantissa bits of the float64. */
static inline int64_t fine_bin(int64_t x) {
    double v = (double)x;
    if (!(v >= 0.5)) v = 0.5;
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    int64_t r = (int64_t)(b >> (52 - SUB_BITS)) - ((int64_t)1022 << SUB_BITS);
    return r < FINE_BINS - 1 ? r : FINE_BINS - 1;
}

/* Pass 1, over the kernels (in (group, step, start) order): units (a run of one group key,
 * step and phase), their merged runs of kernels, busy time, and the idle gaps between the
 * runs of a unit. gk == NULL: every kernel has group key gk0. Outputs have room for n.
 * Returns the number of units; *n_gaps the number of gaps. */
EXPORT int64_t rl_fold_units(int64_t n, const int64_t *s, const int64_t *e_in, const int64_t *ph,
                             const int64_t *stp, const int64_t *gk, int64_t gk0,
                             int64_t *u_first, int64_t *u_start, int64_t *u_end, int64_t *u_busy,
                             int64_t *u_kt, int64_t *u_ukey,
                             int64_t *gap_start, int64_t *gap_len, int64_t *gap_unit, int64_t *n_gaps) {
    int64_t nu = -1, ng = 0;
    int64_t prev_ukey = 0, prev_step = 0;
    int64_t run_s = 0, run_e = 0, busy = 0, kt = 0, uend = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t si = s[i], ei = e_in[i] > si ? e_in[i] : si;
        int64_t ukey = (int64_t)((uint64_t)(gk ? gk[i] : gk0) << 3) | ph[i];
        if (nu < 0 || ukey != prev_ukey || stp[i] != prev_step) {
            if (nu >= 0) {
                busy += run_e - run_s;
                u_busy[nu] = busy; u_kt[nu] = kt; u_end[nu] = uend;
            }
            nu++;
            u_first[nu] = i; u_start[nu] = si; u_ukey[nu] = ukey;
            prev_ukey = ukey; prev_step = stp[i];
            run_s = si; run_e = ei; busy = 0; kt = 0; uend = ei;
        } else if (si > run_e) {            /* a new merged run: the gap before it */
            busy += run_e - run_s;
            gap_start[ng] = run_e; gap_len[ng] = si - run_e; gap_unit[ng] = nu; ng++;
            run_s = si; run_e = ei;
        } else if (ei > run_e) {
            run_e = ei;
        }
        kt += ei - si;
        if (ei > uend) uend = ei;
    }
    if (nu >= 0) {
        busy += run_e - run_s;
        u_busy[nu] = busy; u_kt[nu] = kt; u_end[nu] = uend;
    }
    *n_gaps = ng;
    return nu + 1;
}

/* Nanoseconds of [a, b) covered by sorted disjoint intervals [hs, he). *hint: where the
 * previous search ended; gaps come nearly in time order, so the search gallops from there
 * (a few steps) instead of bisecting the whole table (cache misses per gap). */
static int64_t cover(int64_t a, int64_t b, int64_t nh, const int64_t *hs, const int64_t *he, int64_t *hint) {
    int64_t lo, hi, p = *hint < nh ? *hint : nh - 1;
    if (p > 0 && he[p - 1] > a) {       /* behind the hint: bisect [0, p) */
        lo = 0; hi = p;
    } else if (he[p] > a) {             /* the hint itself */
        lo = hi = p;
    } else {                            /* ahead: gallop, then bisect */
        int64_t step = 1;
        lo = p + 1; hi = lo;
        while (hi < nh && he[hi] <= a) { lo = hi + 1; hi += step; step <<= 1; }
        if (hi > nh) hi = nh;
    }
    while (lo < hi) {                   /* first interval ending after a */
        int64_t mid = lo + (hi - lo) / 2;
        if (he[mid] <= a) lo = mid + 1; else hi = mid;
    }
    *hint = lo;
    int64_t c = 0;
    for (int64_t j = lo; j < nh && hs[j] < b; j++) {
        int64_t x = hs[j] > a ? hs[j] : a, y = he[j] < b ? he[j] : b;
        if (y > x) c += y - x;
    }
    return c;
}

/* Pass 2, over the units' kernels and the gaps: the integer sums and histograms of each
 * row (u_row: the row of each unit) added into add[rows][nf] and
 * hist[rows][3][FINE_BINS]. lat: launch latency per kernel (-1 unknown). Host intervals
 * (launch calls, sync calls): sorted, disjoint; n 0 for none. */
EXPORT void rl_fold_rows(int64_t n, const int64_t *s, const int64_t *e_in, const int64_t *lat,
                         int64_t nu, const int64_t *u_first, const int64_t *u_busy, const int64_t *u_kt,
                         const int64_t *u_row,
                         int64_t n_gaps, const int64_t *gap_start, const int64_t *gap_len, const int64_t *gap_unit,
                         int64_t nhl, const int64_t *hl_s, const int64_t *hl_e,
                         int64_t nhs, const int64_t *hs_s, const int64_t *hs_e,
                         int64_t nf, int64_t *add, int64_t *hist) {
    for (int64_t u = 0; u < nu; u++) {
        int64_t r = u_row[u];
        int64_t *a = add + r * nf;
        int64_t *hk = hist + (r * 3 + H_KERNEL) * FINE_BINS, *hl = hist + (r * 3 + H_LAUNCH) * FINE_BINS;
        int64_t i0 = u_first[u], i1 = u + 1 < nu ? u_first[u + 1] : n;
        int64_t nl = 0, ls = 0;
        for (int64_t i = i0; i < i1; i++) {
            int64_t si = s[i], ei = e_in[i] > si ? e_in[i] : si;
            hk[fine_bin(ei - si)]++;
            if (lat[i] >= 0) { hl[fine_bin(lat[i])]++; nl++; ls += lat[i]; }
        }
        a[I_KERNELS] += i1 - i0;
        a[I_KERNEL_TIME] += u_kt[u];
        a[I_BUSY] += u_busy[u];
        a[I_LAUNCH_KERNELS] += nl;
        a[I_LAUNCH_LATENCY] += ls;
    }
    int64_t hint_l = 0, hint_s = 0;
    for (int64_t g = 0; g < n_gaps; g++) {
        int64_t r = u_row[gap_unit[g]];
        int64_t *a = add + r * nf;
        int64_t g0 = gap_start[g], g1 = g0 + gap_len[g];
        a[I_GAPS]++;
        a[I_GAP_NS] += gap_len[g];
        hist[(r * 3 + H_GAP) * FINE_BINS + fine_bin(gap_len[g])]++;
        if (nhl) a[I_GAP_LAUNCH] += cover(g0, g1, nhl, hl_s, hl_e, &hint_l);
        if (nhs) a[I_GAP_SYNC] += cover(g0, g1, nhs, hs_s, hs_e, &hint_s);
    }
}


/* phase_figures.launch_latency_ns when each kernel's launch record is the record at the
 * same index (one launch record per kernel, in the same order: what CUPTI and the
 * simulator deliver): returns 0, having written nothing, when a record is not a launch
 * (launch[category] 0), any correlation id differs or the records' ids are not in order
 * (the caller then joins as the reference does); else lat[i] = max(kernel start - launch start, 0),
 * -1 where the correlation id is negative. Kernels and records: n each. */
EXPORT int64_t rl_launch_latency_aligned(const char *kb, int64_t ks, int64_t k_start, int64_t k_corr,
                                         const char *ab, int64_t as, int64_t a_start, int64_t a_corr,
                                         int64_t a_cat, const uint8_t *launch, int64_t n, int64_t *lat) {
    for (int64_t i = 0; i < n; i++) {
        uint8_t cat;
        memcpy(&cat, ab + i * as + a_cat, 1);
        if (!launch[cat]) return 0;
        int64_t c = rd64(ab, as, i, a_corr);
        /* the records' ids in order too: out of order, the reference sorts them first */
        if (rd64(kb, ks, i, k_corr) != c || (i && c < rd64(ab, as, i - 1, a_corr))) return 0;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t d = rd64(kb, ks, i, k_start) - rd64(ab, as, i, a_start);
        lat[i] = rd64(kb, ks, i, k_corr) < 0 ? -1 : (d > 0 ? d : 0);
    }
    return 1;
}

/* out[q] = the int64 field of record idx[q] (idx NULL: record q): numpy's k[field][idx],
 * in one pass, without the strided copy of the whole column first. */
EXPORT void rl_gather_i64(const char *base, int64_t stride, int64_t off, int64_t n, const int64_t *idx,
                          int64_t *out) {
    for (int64_t q = 0; q < n; q++)
        out[q] = rd64(base, stride, idx ? idx[q] : q, off);
}

/* Smallest and largest value of an int32 field over n records (n >= 1): out[0], out[1]. */
EXPORT void rl_range_i32(const char *base, int64_t stride, int64_t off, int64_t n, int64_t *out) {
    int32_t lo = rd32(base, stride, 0, off), hi = lo;
    for (int64_t i = 1; i < n; i++) {
        int32_t v = rd32(base, stride, i, off);
        if (v < lo) lo = v;
        if (v > hi) hi = v;
    }
    out[0] = lo;
    out[1] = hi;
}

/* aggregator/steps.py (segment_kernels): the per-kernel pass of one device's step cut, over
 * its m kernels in time order (idx: their record indices; NULL: records 0..m-1). The
 * Python function _scan_reference in steps.py is the reference (the same arrays with numpy;
 * tests/test_steps_native.py compares them). Per kernel a flag byte: flags[name slot] when
 * by_name (slot = name_id when 0 <= name_id < n_flags - 1, else n_flags - 1: the "no name"
 * row of the per-name classes), else flags[record index]. Bits: SEG_ATT attention, SEG_TOK
 * per-token, SEG_TOK_STRONG per-token with the tokens grid rule and strong evidence,
 * SEG_END sampling (closes a step), SEG_OPT optimizer. Writes gaps[m - 1] (steps.py
 * _idle_gaps: idle time between kernel q and q + 1 after the running maximum of the ends)
 * and the positions (0..m-1) of: pos[0] attention kernels (val[0]: their name ids),
 * pos[1] strong per-token kernels with grid.x > 0 (val[1]: grid.x), pos[2] layer kernels
 * (attention or per-token), pos[3] sampling kernels, pos[4] optimizer kernels, pos[5]
 * the first kernel of each CUDA graph launch (graph id >= 0 and the first kernel, or a
 * new correlation id or graph id; val[2]: the graph id); cnt[6] how many of each. Each
 * plane has room for m. off[6]: offsets of start_ns, end_ns, name_id, grid_x, graph_id,
 * correlation_id. Returns 0, with nothing useful written, when the starts are not in
 * order (the caller sorts and calls again with idx), else 1. */
enum { SEG_ATT = 1, SEG_TOK = 2, SEG_TOK_STRONG = 4, SEG_END = 8, SEG_OPT = 16 };
EXPORT int64_t rl_segment_scan(const char *base, int64_t stride, const int64_t *off, int64_t m, const int64_t *idx,
                               const uint8_t *flags, int64_t n_flags, int64_t by_name,
                               int64_t *gaps, int64_t *pos, int64_t *val, int64_t *cnt) {
    /* The offsets in locals (the int64 stores below may alias off for the compiler), and
     * the order check in the one pass over the records (it was a pass of its own: at 50k
     * kernels a second a fold's records do not stay in the core's cache between passes);
     * what the loop wrote before finding starts out of order is "nothing useful". */
    const int64_t o_start = off[0], o_end = off[1], o_name = off[2], o_gx = off[3], o_gid = off[4],
                  o_corr = off[5];
    int64_t *p_att = pos, *p_tok = pos + m, *p_lay = pos + 2 * m, *p_end = pos + 3 * m, *p_opt = pos + 4 * m,
            *p_gr = pos + 5 * m;
    int64_t *v_att = val, *v_tok = val + m, *v_gr = val + 2 * m;
    int64_t na = 0, nt = 0, nl = 0, ne = 0, no = 0, ng = 0;
    int64_t busy = 0, prev_corr = 0, prev_s = 0;
    int64_t prev_gid = -1;
    for (int64_t q = 0; q < m; q++) {
        int64_t i = idx ? idx[q] : q;
        int64_t s = rd64(base, stride, i, o_start), e = rd64(base, stride, i, o_end);
        if (q) {
            if (s < prev_s) return 0;
            int64_t g = s - busy;
            gaps[q - 1] = g > 0 ? g : 0;
            if (e > busy) busy = e;
        } else {
            busy = e;
        }
        prev_s = s;
        int32_t nid = rd32(base, stride, i, o_name);
        uint8_t f;
        if (by_name)
            f = flags[nid >= 0 && nid < n_flags - 1 ? nid : n_flags - 1];
        else
            f = flags[i];
        if (f & SEG_ATT) { p_att[na] = q; v_att[na++] = nid; }
        if (f & SEG_TOK_STRONG) {
            int32_t gx = rd32(base, stride, i, o_gx);
            if (gx > 0) { p_tok[nt] = q; v_tok[nt++] = gx; }
        }
        if (f & (SEG_ATT | SEG_TOK)) p_lay[nl++] = q;
        if (f & SEG_END) p_end[ne++] = q;
        if (f & SEG_OPT) p_opt[no++] = q;
        int64_t gid = rd64(base, stride, i, o_gid);
        int64_t corr = rd64(base, stride, i, o_corr);
        if (gid >= 0 && (q == 0 || corr != prev_corr || gid != prev_gid)) { p_gr[ng] = q; v_gr[ng++] = gid; }
        prev_corr = corr;
        prev_gid = gid;
    }
    cnt[0] = na; cnt[1] = nt; cnt[2] = nl; cnt[3] = ne; cnt[4] = no; cnt[5] = ng;
    return 1;
}

/* aggregator/windows.py (SourceFold._fold_kernels) -> phase_figures.fold_records: rl_fold_units
 * and rl_fold_rows in one pass, read straight from the batch's packed records through the
 * (step, start) order, without the gathered columns, the per-kernel group keys and the
 * separate calls (each with its arrays and argument conversions) of the general path. The
 * reference is the general path itself (fold_native.gather, group_key, rl_fold_units,
 * rl_fold_rows: the same units, gaps and sums; tests/test_fold_native.py compares them).
 *
 * Kernels: record order[q] for q < n (order NULL: record q), koff[4] the byte offsets of
 * start_ns, end_ns, device (int32), pid (int32); phase (uint8), kstep and lat (int64,
 * -1 unknown) per record. A kernel's group key is device << 32 | (uint32)pid
 * (phase_figures.group_key). Rows: one per distinct unit key, numbered in order of first
 * appearance, at most max_rows; row_key[r] its key; add[max_rows][nf] and
 * hist[max_rows][3][FINE_BINS] (zeroed by the caller) get each row's sums, as rl_fold_rows.
 * gap_log2[max_rows][64] (zeroed): each row's gaps in windows.log2_bins (the device's idle
 * histogram). Host intervals as rl_fold_rows'. ws: 10 planes of n int64 for the units (first, start,
 * end, busy, kernel time, key, step, group key, kernels, row) then 2 for the gaps (length,
 * unit). out[3]: units, gaps, rows. Returns 1, or 0 (nothing useful written) when the
 * kernels hold more than max_rows distinct unit keys (the caller takes the general path). */
/* windows.log2_bins: 0 for <= 0, else the binary exponent (1 -> 1, 2..3 -> 2, ...), at most 63. */
#define LOG2_BINS 64
static inline int64_t log2_bin(int64_t x) {
    double v = (double)x;
    if (!(v >= 0.5)) v = 0.5;
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    int64_t e = (int64_t)(b >> 52) - 1022;
    return e < LOG2_BINS - 1 ? e : LOG2_BINS - 1;
}

EXPORT int64_t rl_fold_batch(const char *kb, int64_t ks, const int64_t *koff, int64_t n, const int64_t *order,
                             const uint8_t *phase, const int64_t *kstep, const int64_t *lat,
                             int64_t nhl, const int64_t *hl_s, const int64_t *hl_e,
                             int64_t nhs, const int64_t *hs_s, const int64_t *hs_e,
                             int64_t nf, int64_t max_rows, int64_t *row_key, int64_t *add, int64_t *hist,
                             int64_t *gap_log2, int64_t *ws, int64_t *out) {
    int64_t *u_first = ws, *u_start = ws + n, *u_end = ws + 2 * n, *u_busy = ws + 3 * n, *u_kt = ws + 4 * n,
            *u_ukey = ws + 5 * n, *u_step = ws + 6 * n, *u_gk = ws + 7 * n, *u_cnt = ws + 8 * n,
            *u_row = ws + 9 * n, *gap_len = ws + 10 * n, *gap_unit = ws + 11 * n;
    int64_t nu = -1, ng = 0, nr = 0, r = -1;
    int64_t prev_ukey = 0, prev_step = 0;
    int64_t run_s = 0, run_e = 0, busy = 0, kt = 0, uend = 0, nl = 0, ls = 0;
    int64_t hint_l = 0, hint_s = 0;
    int64_t *a = add, *hk = hist, *hg = hist, *hlat = hist, *h2 = gap_log2;
    for (int64_t q = 0; q < n; q++) {
        int64_t i = order ? order[q] : q;
        int64_t si = rd64(kb, ks, i, koff[0]), ei = rd64(kb, ks, i, koff[1]);
        if (ei < si) ei = si;
        int64_t gk = (int64_t)(((uint64_t)(int64_t)rd32(kb, ks, i, koff[2]) << 32)
                               | (uint32_t)rd32(kb, ks, i, koff[3]));
        int64_t ukey = (int64_t)((uint64_t)gk << 3) | phase[i];
        int64_t st = kstep[i];
        if (nu < 0 || ukey != prev_ukey || st != prev_step) {
            if (nu >= 0) {
                busy += run_e - run_s;
                u_busy[nu] = busy; u_kt[nu] = kt; u_end[nu] = uend; u_cnt[nu] = q - u_first[nu];
                a[I_KERNELS] += q - u_first[nu]; a[I_KERNEL_TIME] += kt; a[I_BUSY] += busy;
                a[I_LAUNCH_KERNELS] += nl; a[I_LAUNCH_LATENCY] += ls;
            }
            if (nu < 0 || ukey != prev_ukey) {   /* the row of the new key: the last one, else a search */
                int64_t j = 0;
                while (j < nr && row_key[j] != ukey) j++;
                if (j == nr) {
                    if (nr == max_rows) return 0;
                    row_key[nr++] = ukey;
                }
                r = j;
                a = add + r * nf;
                hk = hist + (r * 3 + H_KERNEL) * FINE_BINS;
                hg = hist + (r * 3 + H_GAP) * FINE_BINS;
                hlat = hist + (r * 3 + H_LAUNCH) * FINE_BINS;
                h2 = gap_log2 + r * LOG2_BINS;
            }
            nu++;
            u_first[nu] = q; u_start[nu] = si; u_ukey[nu] = ukey; u_step[nu] = st; u_gk[nu] = gk; u_row[nu] = r;
            prev_ukey = ukey; prev_step = st;
            run_s = si; run_e = ei; busy = 0; kt = 0; uend = ei; nl = 0; ls = 0;
        } else if (si > run_e) {            /* a new merged run: the gap before it */
            int64_t g = si - run_e;
            busy += run_e - run_s;
            gap_len[ng] = g; gap_unit[ng] = nu; ng++;
            a[I_GAPS]++;
            a[I_GAP_NS] += g;
            hg[fine_bin(g)]++;
            h2[log2_bin(g)]++;
            if (nhl) a[I_GAP_LAUNCH] += cover(run_e, si, nhl, hl_s, hl_e, &hint_l);
            if (nhs) a[I_GAP_SYNC] += cover(run_e, si, nhs, hs_s, hs_e, &hint_s);
            run_s = si; run_e = ei;
        } else if (ei > run_e) {
            run_e = ei;
        }
        kt += ei - si;
        if (ei > uend) uend = ei;
        hk[fine_bin(ei - si)]++;
        int64_t li = lat[i];
        if (li >= 0) { hlat[fine_bin(li)]++; nl++; ls += li; }
    }
    if (nu >= 0) {
        busy += run_e - run_s;
        u_busy[nu] = busy; u_kt[nu] = kt; u_end[nu] = uend; u_cnt[nu] = n - u_first[nu];
        a[I_KERNELS] += n - u_first[nu]; a[I_KERNEL_TIME] += kt; a[I_BUSY] += busy;
        a[I_LAUNCH_KERNELS] += nl; a[I_LAUNCH_LATENCY] += ls;
    }
    out[0] = nu + 1; out[1] = ng; out[2] = nr;
    return 1;
}

/* phase_figures.host_intervals: phase_figures._union for the two kinds of host call in one
 * pass over the records. kind[category]: 1 launch, 2 sync, 0 neither. Writes the launch
 * intervals to ws[0..n), ws[n..2n) (start, end) and the sync intervals to ws[2n..3n),
 * ws[3n..4n); out[0], out[1] their counts. Returns bits: 1 the launch intervals, 2 the sync
 * intervals are the finished union (that kind's records came in start order). A kind whose
 * records are not in start order (several threads' calls, a trace of concatenated runs) keeps
 * what it merged while they were, then the rest of its (start, max(end, start)) pairs as they
 * come: the same union, which the caller sorts by start and finishes with rl_union_sorted. */
EXPORT int64_t rl_host_unions(const char *base, int64_t stride, int64_t off_start, int64_t off_end, int64_t off_cat,
                              const uint8_t *kind, int64_t n, int64_t *ws, int64_t *out) {
    int64_t *os[2] = {ws, ws + 2 * n}, *oe[2] = {ws + n, ws + 3 * n};
    int64_t m[2] = {-1, -1}, prev[2] = {0, 0};
    int ordered[2] = {1, 1};
    for (int64_t i = 0; i < n; i++) {
        uint8_t cat;
        memcpy(&cat, base + i * stride + off_cat, 1);
        int k = kind[cat] - 1;
        if (k < 0 || k > 1) continue;
        int64_t s = rd64(base, stride, i, off_start), e = rd64(base, stride, i, off_end);
        if (e < s) e = s;
        if (m[k] >= 0 && s < prev[k]) ordered[k] = 0;
        prev[k] = s;
        if (ordered[k] && m[k] >= 0 && s <= oe[k][m[k]]) {
            if (e > oe[k][m[k]]) oe[k][m[k]] = e;
        } else {
            m[k]++;
            os[k][m[k]] = s; oe[k][m[k]] = e;
        }
    }
    out[0] = m[0] + 1;
    out[1] = m[1] + 1;
    return ordered[0] | (ordered[1] << 1);
}

/* phase_figures._union of n intervals sorted by start (end >= start each), in place: the
 * sorted disjoint intervals (touching ones merged) in s[0..m), e[0..m); returns m. */
EXPORT int64_t rl_union_sorted(int64_t *s, int64_t *e, int64_t n) {
    int64_t m = -1;
    for (int64_t i = 0; i < n; i++) {
        if (m >= 0 && s[i] <= e[m]) {
            if (e[i] > e[m]) e[m] = e[i];
        } else {
            m++;
            s[m] = s[i]; e[m] = e[i];
        }
    }
    return m + 1;
}

/* aggregator/windows.py (SourceFold._ingest): a batch's per-record passes in one, over its
 * nk kernels and na API records: rl_range_i32 of the kernels' device, the launch-call
 * duration histogram (windows.log2_bins of max(end - start, 0), 64 bins, as the general numpy
 * path in _ingest) and rl_launch_latency_aligned, with their rules. koff[3]: kernel start_ns, correlation_id,
 * device; aoff[6]: API start_ns, end_ns, correlation_id, category, pid, tid. Returns bits:
 * 1 the device range in out[0], out[1] (nk >= 1); 2 hist[64] added (every record a launch,
 * what[category] == 0, of one process and thread: out[2], out[3]); 4 lat[nk] written (one
 * launch record per kernel, launch[category], same correlation ids in order). Without bit 4,
 * lat holds nothing useful. */
EXPORT int64_t rl_ingest_pass(const char *kb, int64_t ks, const int64_t *koff, int64_t nk,
                              const char *ab, int64_t as, const int64_t *aoff, int64_t na,
                              const uint8_t *what, const uint8_t *launch, int64_t *hist, int64_t *lat,
                              int64_t *out) {
    /* The offsets in locals: the int64 stores into lat may alias koff and aoff for the
     * compiler, which would reload all nine for every record. */
    const int64_t k_start = koff[0], k_corr = koff[1], k_dev = koff[2];
    const int64_t a_start = aoff[0], a_end = aoff[1], a_corr = aoff[2], a_cat = aoff[3], a_pid = aoff[4],
                  a_tid = aoff[5];
    int64_t h[LOG2_BINS] = {0};
    int ok_hist = na > 0, ok_lat = nk == na && nk > 0;
    int32_t pid = na ? rd32(ab, as, 0, a_pid) : 0, tid = na ? rd32(ab, as, 0, a_tid) : 0;
    int64_t prev = 0;
    /* The kernels' device range is taken in the same loop while the records are aligned
     * (kernel i read there anyway): a second pass over the kernel records only for the
     * kernels this loop did not read. The records do not fit in the core's cache at 50k
     * kernels a second (2.7 MB per fold), so each pass over them costs their reading. */
    int32_t lo = nk ? rd32(kb, ks, 0, k_dev) : 0, hi = lo;
    int64_t ranged = 0;
    for (int64_t i = 0; i < na && (ok_hist || ok_lat); i++) {
        uint8_t cat;
        memcpy(&cat, ab + i * as + a_cat, 1);
        int64_t a_s = rd64(ab, as, i, a_start);
        if (ok_hist) {
            if (what[cat] != 0 || rd32(ab, as, i, a_pid) != pid || rd32(ab, as, i, a_tid) != tid) {
                ok_hist = 0;
            } else {
                int64_t d = rd64(ab, as, i, a_end) - a_s;
                h[log2_bin(d > 0 ? d : 0)]++;
            }
        }
        if (ok_lat) {
            int64_t c = rd64(ab, as, i, a_corr), kc = rd64(kb, ks, i, k_corr);
            if (!launch[cat] || kc != c || (i && c < prev)) {
                ok_lat = 0;
            } else {
                int64_t d = rd64(kb, ks, i, k_start) - a_s;
                lat[i] = kc < 0 ? -1 : (d > 0 ? d : 0);
                int32_t v = rd32(kb, ks, i, k_dev);
                if (v < lo) lo = v;
                if (v > hi) hi = v;
                ranged = i + 1;
            }
            prev = c;
        }
    }
    int64_t bits = 0;
    if (nk > 0) {
        for (int64_t i = ranged; i < nk; i++) {
            int32_t v = rd32(kb, ks, i, k_dev);
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
        out[0] = lo; out[1] = hi;
        bits |= 1;
    }
    if (ok_hist) {
        for (int j = 0; j < LOG2_BINS; j++) hist[j] += h[j];
        out[2] = pid; out[3] = tid;
        bits |= 2;
    }
    if (ok_lat) bits |= 4;
    return bits;
}

/* aggregator/windows.py (SourceFold._carry_records, a kernel stream's held steps): the API
 * records kept with the held kernels, mask[i] = 1 when record i ends at or after t0 (the
 * held steps' first start) or its correlation id is one of the held kernels' (held: m ids
 * sorted ascending), else 0, in one pass over the records. The numpy reference (the
 * expression it replaces, np.isin over every record: a sort of records and ids together,
 * 20% of the fold at 8 GPUs x 100k kernels/s) is in _carry_records under
 * fold_native.REFERENCE; tests/test_fold_native_carry.py compares them. The binary search
 * runs only for records ending before t0 whose id lies within the held ids' range.
 * off: byte offsets of end_ns and correlation_id (int64). Returns the number of records kept. */
EXPORT int64_t rl_carry_api_mask(const char *base, int64_t stride, int64_t off_end, int64_t off_corr, int64_t n,
                                 int64_t t0, const int64_t *held, int64_t m, uint8_t *mask) {
    int64_t kept = 0;
    const int64_t lo_id = m ? held[0] : 0, hi_id = m ? held[m - 1] : -1;
    for (int64_t i = 0; i < n; i++) {
        uint8_t keep = rd64(base, stride, i, off_end) >= t0;
        if (!keep && m) {
            int64_t c = rd64(base, stride, i, off_corr);
            if (c >= lo_id && c <= hi_id) {
                int64_t a = 0, b = m;          /* first held id >= c, in [a, b) */
                while (a < b) {
                    int64_t h = a + (b - a) / 2;
                    if (held[h] < c) a = h + 1; else b = h;
                }
                keep = a < m && held[a] == c;
            }
        }
        mask[i] = keep;
        kept += keep;
    }
    return kept;
}

/* The agent's per-record CUPTI passes (probes/cupti/decode.py), one pass each, no Python
 * object per record: a section of raw kernel or API records -> KERNEL_DTYPE / API_DTYPE rows
 * (range checks, name ids, callback tables), and the correlation-id joins of
 * ProcessDecoder.take (launching thread, launch latency, external id).
 *
 * The numpy code in decode.py is the reference (decode_kernels, valid_records, name_ids,
 * ProcessDecoder._decode_api, the _Index joins); tests/test_cupti_decode_native.py checks both
 * give the same bytes on the records of every CUPTI header set the project supports and on
 * adversarial sections. Record layouts are not known here: the caller passes each field's
 * byte offset from probes/cupti/layouts.py's per-version layout (and the record size as the
 * stride), and the offsets of the output columns; decode_native.py checks the field widths
 * this file reads agree with those layouts before using it.
 *
 * Fields are read and written with memcpy: records and numpy rows are packed, unaligned.
 * No global state, no allocation: the caller (numpy) owns every buffer, the joins' index
 * memory included. Thread-safe.
 */
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

/* Kept equal to decode.py (MAX_TIMESTAMP_NS, MAX_DURATION_NS, MISSING) and protocol.py
 * (MAX_DEVICE_ID); rl_decode_abi() returns them for the loader to compare. */
#define MAX_TIMESTAMP_NS ((uint64_t)INT64_MAX)
#define MAX_DURATION_NS ((uint64_t)86400 * 1000000000ull)
#define MAX_DEVICE_ID 1023u
#define MISSING (-1)
#define API_GRAPH_LAUNCH 2
#define ABI_VERSION 1

EXPORT int64_t rl_decode_abi(int64_t *out) {
    out[0] = (int64_t)MAX_TIMESTAMP_NS;
    out[1] = (int64_t)MAX_DURATION_NS;
    out[2] = MAX_DEVICE_ID;
    out[3] = MISSING;
    out[4] = API_GRAPH_LAUNCH;
    return ABI_VERSION;
}

#define RD(T, p) ({ T v_; memcpy(&v_, (p), sizeof v_); v_; })
#define WR(T, p, x) do { T v_ = (T)(x); memcpy((p), &v_, sizeof v_); } while (0)

/* decode.valid_records' timestamp check (unsigned arithmetic, as there: start 0 and an end
 * before the start wrap to huge values). */
static inline int bad_span(uint64_t start, uint64_t end) {
    return (start - 1u) >= MAX_TIMESTAMP_NS || end > MAX_TIMESTAMP_NS || (end - start) > MAX_DURATION_NS;
}

/* decode.ProcessDecoder.name_ids for one pointer: the id of ``p`` in the sorted unique
 * ``ptrs`` (searchsorted left + equality), MISSING when absent. */
static inline int32_t name_id(uint64_t p, const uint64_t *ptrs, const int32_t *ids, int64_t n) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (ptrs[mid] < p) lo = mid + 1; else hi = mid;
    }
    return (lo < n && ptrs[lo] == p) ? ids[lo] : MISSING;
}

/* Input fields of a kernel record, in this order (widths: decode_native.KERNEL_IN). */
enum { KI_START, KI_END, KI_DEVICE, KI_STREAM, KI_CONTEXT, KI_CORR, KI_GX, KI_GY, KI_GZ, KI_BX, KI_BY,
       KI_BZ, KI_REGS, KI_SSM, KI_DSM, KI_NAME, KI_GRAPH, KI_NODE, KI_N };
/* Output columns of KERNEL_DTYPE, in this order (decode_native.KERNEL_OUT). */
enum { KO_START, KO_END, KO_DEVICE, KO_STREAM, KO_CONTEXT, KO_CORR, KO_EXT, KO_GX, KO_GY, KO_GZ, KO_BX,
       KO_BY, KO_BZ, KO_REGS, KO_SHM, KO_NAME, KO_GRAPH, KO_NODE, KO_PID, KO_TID, KO_N };

/* decode_kernels after valid_records and name_ids: the ``n`` records at ``src`` (``stride``
 * bytes apart) that pass the range checks become rows at ``dst`` (``dst_stride`` apart), in
 * order. counts[0] = records failing the timestamp check, counts[1] = failing the device
 * check (one failing both counts in both), counts[2] = non-NULL names not in ``ptrs``
 * (of the records kept). Returns the rows written. */
EXPORT int64_t rl_decode_kernels(const uint8_t *src, int64_t n, int64_t stride, const int64_t *in,
                                 uint8_t *dst, int64_t dst_stride, const int64_t *out,
                                 const uint64_t *ptrs, const int32_t *ptr_ids, int64_t n_ptrs,
                                 int32_t pid, int64_t *counts) {
    int64_t w = 0, bad_ts = 0, bad_dev = 0, unresolved = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = src + i * stride;
        uint64_t start = RD(uint64_t, r + in[KI_START]), end = RD(uint64_t, r + in[KI_END]);
        uint32_t dev = RD(uint32_t, r + in[KI_DEVICE]);
        int ts = bad_span(start, end), dv = dev > MAX_DEVICE_ID;
        bad_ts += ts;
        bad_dev += dv;
        if (ts | dv) continue;
        uint8_t *o = dst + w * dst_stride;
        w++;
        WR(int64_t, o + out[KO_START], start);
        WR(int64_t, o + out[KO_END], end);
        WR(int32_t, o + out[KO_DEVICE], dev);
        WR(int64_t, o + out[KO_STREAM], RD(uint32_t, r + in[KI_STREAM]));
        uint32_t ctx = RD(uint32_t, r + in[KI_CONTEXT]);
        WR(int32_t, o + out[KO_CONTEXT], ctx > (uint32_t)INT32_MAX ? (uint32_t)INT32_MAX : ctx);
        WR(int64_t, o + out[KO_CORR], RD(uint32_t, r + in[KI_CORR]));
        WR(int64_t, o + out[KO_EXT], MISSING);
        WR(int32_t, o + out[KO_GX], RD(int32_t, r + in[KI_GX]));
        WR(int32_t, o + out[KO_GY], RD(int32_t, r + in[KI_GY]));
        WR(int32_t, o + out[KO_GZ], RD(int32_t, r + in[KI_GZ]));
        WR(int32_t, o + out[KO_BX], RD(int32_t, r + in[KI_BX]));
        WR(int32_t, o + out[KO_BY], RD(int32_t, r + in[KI_BY]));
        WR(int32_t, o + out[KO_BZ], RD(int32_t, r + in[KI_BZ]));
        WR(int32_t, o + out[KO_REGS], RD(uint16_t, r + in[KI_REGS]));
        /* int32 + int32 wrapping, as numpy's: unsigned sum, then the bits */
        uint32_t shm = (uint32_t)RD(int32_t, r + in[KI_SSM]) + (uint32_t)RD(int32_t, r + in[KI_DSM]);
        WR(uint32_t, o + out[KO_SHM], shm);
        uint64_t np_ = (uint64_t)RD(int64_t, r + in[KI_NAME]);
        int32_t nid = n_ptrs ? name_id(np_, ptrs, ptr_ids, n_ptrs) : MISSING;
        unresolved += (nid == MISSING) & (np_ != 0);
        WR(int32_t, o + out[KO_NAME], nid);
        /* decode._nz: 0 (and ids past int64) read "no graph" */
        int64_t g = (int64_t)RD(uint32_t, r + in[KI_GRAPH]);
        WR(int64_t, o + out[KO_GRAPH], g <= 0 ? MISSING : g);
        int64_t gn = (int64_t)RD(uint64_t, r + in[KI_NODE]);
        WR(int64_t, o + out[KO_NODE], gn <= 0 ? MISSING : gn);
        WR(int32_t, o + out[KO_PID], pid);
        WR(int32_t, o + out[KO_TID], MISSING);
    }
    counts[0] = bad_ts;
    counts[1] = bad_dev;
    counts[2] = unresolved;
    return w;
}

enum { AI_CBID, AI_START, AI_END, AI_TID, AI_CORR, AI_N };
enum { AO_START, AO_END, AO_PID, AO_TID, AO_CORR, AO_EXT, AO_CBID, AO_DOMAIN, AO_CAT, AO_NAME, AO_N };

/* ProcessDecoder._decode_api after valid_records and the CPU clock check: records passing the
 * timestamp check, and (check_clock) whose start lies in [floor_ns, ahead_ns], become API_DTYPE
 * rows. ``cat``/``cat_name`` (``n_cat`` entries, 0: none) map a callback id to its category and
 * name id, API_OTHER (0) / MISSING beyond. counts[0] = timestamp failures, counts[1] = clock
 * disagreements (of the records passing the timestamp check). Returns the rows written. */
EXPORT int64_t rl_decode_api(const uint8_t *src, int64_t n, int64_t stride, const int64_t *in,
                             uint8_t *dst, int64_t dst_stride, const int64_t *out, int32_t pid, int32_t domain,
                             const uint8_t *cat, const int32_t *cat_name, int64_t n_cat,
                             int32_t check_clock, uint64_t floor_ns, uint64_t ahead_ns, int64_t *counts) {
    int64_t w = 0, bad_ts = 0, bad_clock = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = src + i * stride;
        uint64_t start = RD(uint64_t, r + in[AI_START]), end = RD(uint64_t, r + in[AI_END]);
        if (bad_span(start, end)) { bad_ts++; continue; }
        if (check_clock && (start > ahead_ns || start < floor_ns)) { bad_clock++; continue; }
        uint8_t *o = dst + w * dst_stride;
        w++;
        uint32_t cb = RD(uint32_t, r + in[AI_CBID]);
        WR(int64_t, o + out[AO_START], start);
        WR(int64_t, o + out[AO_END], end);
        WR(int32_t, o + out[AO_PID], pid);
        WR(uint32_t, o + out[AO_TID], RD(uint32_t, r + in[AI_TID]));     /* int32 bits, as numpy's cast */
        WR(int64_t, o + out[AO_CORR], RD(uint32_t, r + in[AI_CORR]));
        WR(int64_t, o + out[AO_EXT], MISSING);
        WR(uint32_t, o + out[AO_CBID], cb);
        WR(uint8_t, o + out[AO_DOMAIN], domain);
        int inside = (int64_t)cb < n_cat;
        WR(uint8_t, o + out[AO_CAT], inside ? cat[cb] : 0);
        WR(int32_t, o + out[AO_NAME], inside ? cat_name[cb] : MISSING);
    }
    counts[0] = bad_ts;
    counts[1] = bad_clock;
    return w;
}

/* Positions of correlation ids, the last record of a repeated id winning (decode._Index's
 * rule). Ids of one process come from one counter, so a batch's are nearly dense: a direct
 * table when their range is at most 8x the count (as _Index), else open addressing. The
 * memory is the caller's (``scratch``, reused across calls: a fresh table per call cost a page
 * fault per 4 KiB, more than the join itself). */
typedef struct { int64_t lo; uint64_t span; int64_t *pos; int64_t *key; uint64_t mask; } index_t;

static inline uint64_t slot_of(int64_t k, uint64_t mask) {
    return ((uint64_t)k * 0x9E3779B97F4A7C15ull >> 20) & mask;
}

/* Scratch int64s the index of these ``n`` ids needs; sets up ix->lo/span/mask. */
static uint64_t index_need(index_t *ix, const uint8_t *base, int64_t n, int64_t stride, int64_t off) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = RD(int64_t, base + i * stride + off);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    uint64_t span = (uint64_t)hi - (uint64_t)lo;
    ix->lo = lo;
    if (span < 8u * (uint64_t)n + 1024u) {
        ix->span = span + 1;
        ix->mask = 0;
        return span + 1;
    }
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap <<= 1;
    ix->span = 0;
    ix->mask = cap - 1;
    return 2 * cap;
}

static void index_build(index_t *ix, int64_t *scratch, const uint8_t *base, int64_t n, int64_t stride,
                        int64_t off) {
    ix->pos = scratch;
    if (ix->span) {
        for (uint64_t j = 0; j < ix->span; j++) ix->pos[j] = -1;
        for (int64_t i = 0; i < n; i++)
            ix->pos[(uint64_t)RD(int64_t, base + i * stride + off) - (uint64_t)ix->lo] = i;
        return;
    }
    ix->key = scratch + ix->mask + 1;
    for (uint64_t j = 0; j <= ix->mask; j++) ix->pos[j] = -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = RD(int64_t, base + i * stride + off);
        uint64_t s = slot_of(k, ix->mask);
        while (ix->pos[s] >= 0 && ix->key[s] != k) s = (s + 1) & ix->mask;
        ix->key[s] = k;
        ix->pos[s] = i;
    }
}

static inline int64_t index_find(const index_t *ix, int64_t k) {
    if (ix->span) {
        uint64_t rel = (uint64_t)k - (uint64_t)ix->lo;
        return rel < ix->span ? ix->pos[rel] : -1;
    }
    uint64_t s = slot_of(k, ix->mask);
    while (ix->pos[s] >= 0) {
        if (ix->key[s] == k) return ix->pos[s];
        s = (s + 1) & ix->mask;
    }
    return -1;
}

/* Offsets: k[0..3] kernels' correlation_id, external_id, tid, start_ns; c[0..1] copies'
 * correlation_id, tid; n[0..1] new API records' correlation_id, external_id; a[0..3] all API
 * records' correlation_id, tid, start_ns, category; e[0..1] external correlations'
 * correlation_id, external_id.
 *
 * ProcessDecoder.take's joins: every kernel and new API record gets the external id of its
 * correlation id (MISSING when none; e_used marks the pairs kernels used); every kernel and
 * copy the thread of its API record, a kernel its launch latency (start - API start) in
 * ``latency`` (MISSING when none), a_used marks the API records used. A kernel joined to a
 * graph launch gets graph[i] = 1 (decode._later_graph_nodes then keeps only the first node's
 * latency). counts[0] = kernels whose thread is MISSING afterwards, counts[1] = graph-joined
 * kernels. ``scratch`` holds ``n_scratch`` int64s for the two indexes; when that is too few,
 * nothing is written and the count needed is returned, negated; done, the count used. */
EXPORT int64_t rl_join(uint8_t *kb, int64_t nk, int64_t ks, const int64_t *ko,
                       uint8_t *cb, int64_t nc, int64_t cs, const int64_t *co,
                       uint8_t *nb, int64_t nn, int64_t ns, const int64_t *no,
                       const uint8_t *ab, int64_t na, int64_t as, const int64_t *ao,
                       const uint8_t *eb, int64_t ne, int64_t es, const int64_t *eo,
                       int64_t *latency, uint8_t *a_used, uint8_t *e_used, uint8_t *graph, int64_t *counts,
                       int64_t *scratch, int64_t n_scratch) {
    index_t ei = {0}, ai = {0};
    int use_a = na && (nk || nc);
    uint64_t need_e = ne ? index_need(&ei, eb, ne, es, eo[0]) : 0;
    uint64_t need_a = use_a ? index_need(&ai, ab, na, as, ao[0]) : 0;
    if (need_e + need_a > (uint64_t)n_scratch) return -(int64_t)(need_e + need_a);
    if (ne) index_build(&ei, scratch, eb, ne, es, eo[0]);
    if (use_a) index_build(&ai, scratch + need_e, ab, na, as, ao[0]);
    int64_t unjoined = 0, graphs = 0;
    for (int64_t i = 0; i < nk; i++) {
        uint8_t *r = kb + i * ks;
        int64_t corr = RD(int64_t, r + ko[0]);
        int64_t ext = MISSING;
        if (ne) {
            int64_t p = index_find(&ei, corr);
            if (p >= 0) { ext = RD(int64_t, eb + p * es + eo[1]); e_used[p] = 1; }
        }
        WR(int64_t, r + ko[1], ext);
        int32_t tid = MISSING;
        int64_t lat = MISSING;
        uint8_t g = 0;
        if (use_a) {
            int64_t p = index_find(&ai, corr);
            if (p >= 0) {
                const uint8_t *a = ab + p * as;
                tid = RD(int32_t, a + ao[1]);
                lat = (int64_t)((uint64_t)RD(int64_t, r + ko[3]) - (uint64_t)RD(int64_t, a + ao[2]));
                g = RD(uint8_t, a + ao[3]) == API_GRAPH_LAUNCH;
                a_used[p] = 1;
            }
        }
        WR(int32_t, r + ko[2], tid);
        latency[i] = lat;
        graph[i] = g;
        graphs += g;
        unjoined += tid == MISSING;
    }
    for (int64_t i = 0; i < nc && use_a; i++) {
        uint8_t *r = cb + i * cs;
        int64_t p = index_find(&ai, RD(int64_t, r + co[0]));
        WR(int32_t, r + co[1], p >= 0 ? RD(int32_t, ab + p * as + ao[1]) : MISSING);
        if (p >= 0) a_used[p] = 1;
    }
    for (int64_t i = 0; i < nn; i++) {
        uint8_t *r = nb + i * ns;
        int64_t p = ne ? index_find(&ei, RD(int64_t, r + no[0])) : -1;
        WR(int64_t, r + no[1], p >= 0 ? RD(int64_t, eb + p * es + eo[1]) : MISSING);
    }
    counts[0] = unjoined;
    counts[1] = graphs;
    return (int64_t)(need_e + need_a);
}

/* probes/cupti/probe.py _to_shared_names: the int32 field at ``off`` of ``n`` rows becomes
 * remap[id] (ids >= 0; MISSING stays). The probe extends ``remap`` to every local id before
 * the call; an id past it (none can be) reads MISSING rather than memory beyond it. */
EXPORT void rl_remap_i32(uint8_t *base, int64_t n, int64_t stride, int64_t off, const int32_t *remap,
                         int64_t n_remap) {
    for (int64_t i = 0; i < n; i++) {
        uint8_t *p = base + i * stride + off;
        int32_t id = RD(int32_t, p);
        WR(int32_t, p, id >= 0 && id < n_remap ? remap[id] : MISSING);
    }
}

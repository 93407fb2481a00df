// libridgeline_json.so: Kineto trace events -> numpy rows, straight from the JSON bytes.
//
// The native half of probes/kineto_native.py (issue 21.2). One call per piece of whole
// events (the text between the brackets of the traceEvents array, as
// probes/json_chunks.ArrayStream.pieces() cuts it) parses the piece with simdjson's DOM
// parser (the distribution's libsimdjson: every byte validated, unlike the on-demand API,
// which does not look at values it skips) and writes one row per kept event into the row
// buffer of its kind, laid out as the numpy dtype the caller described (rj_kind): no object
// per event, names interned in a table kept across pieces.
//
// The rules are those of probes/kineto_typed.py and probes/kineto_dicts.py (the reference),
// and the Python side keeps the reference's last word: whenever a piece holds anything this
// file does not read exactly as the reference would (a value of another type than Kineto
// writes, an integer that does not fit its column, a time beyond +-2^62 ns, an unknown
// category, a missing ts, JSON simdjson refuses) rj_piece returns RJ_REFERENCE and the
// caller reads that piece with the reference builder. So this file never has to guess.
//
// Bounds: the caller's pieces are bounded (json_chunks.PIECE_LIMIT); the parser's capacity
// is capped at rj_new's max_bytes and its depth at MAX_DEPTH; the row buffers hold one
// piece; the name tables grow with distinct names only (the caller charges them to its
// budget). No exception leaves this file: allocation failures are caught at the C entry
// points and reported as RJ_ERROR.
#include <simdjson.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

using namespace simdjson;

namespace {

constexpr int RJ_OK = 0, RJ_REFERENCE = 1, RJ_ERROR = 2;
constexpr int NKINDS = 5;          // kineto_records.KINDS order: kernels, copies, api, ranges, cpu_ops
constexpr int K_KERNELS = 0, K_COPIES = 1, K_API = 2, K_RANGES = 3, K_CPU_OPS = 4;
constexpr int64_t MISSING = -1;    // probes.events.MISSING
constexpr int64_t INT32_MAX_ = 0x7fffffff;
// kineto_records.TIME_LIMIT_US (2^62 ns in us): within it float64 holds every integer
// exactly, and the reference's float rule (integer part * 1000 + rounded fraction) and
// int rule agree
constexpr int64_t TIME_LIMIT_US = (int64_t(1) << 62) / 1000;
constexpr int64_t TIME_LIMIT_NS = int64_t(1) << 62;   // kineto_records.TIME_LIMIT_NS
constexpr size_t MAX_DEPTH = 64;   // Kineto events nest 4 deep; deeper pieces go to the reference

// The fields a row may get; the caller says where each one lies in its dtype (rj_kind).
enum Field {
    F_START, F_END, F_NAME, F_PID, F_TID, F_DEVICE, F_STREAM, F_CONTEXT, F_CORR, F_EXT,
    F_REGS, F_SHMEM, F_GX, F_GY, F_GZ, F_BX, F_BY, F_BZ, F_BYTES, F_CBID, F_CAT,
    F_IN_DIMS, F_IN_TYPES, NFIELDS
};

struct Slot { int32_t off, size; };   // size 0: the dtype has no such field

struct Kind {
    int32_t itemsize = 0;
    std::vector<char> tmpl;            // one row of the dtype's defaults
    Slot slot[NFIELDS] = {};
    std::vector<char> rows;
    size_t n = 0;
    // rows kineto_records.reject_invalid_times would look at: a negative duration or an end
    // past +-TIME_LIMIT_NS (none: the caller skips that pass over the columns)
    size_t bad_times = 0;
};

struct Table {                         // strings -> dense ids, in the order first met
    std::deque<std::string> owned;     // a deque never moves its strings: the map's keys view them
    std::unordered_map<std::string_view, int32_t> index;
    int32_t intern(std::string_view s) {
        auto it = index.find(s);
        if (it != index.end()) return it->second;
        owned.emplace_back(s);
        int32_t id = (int32_t)owned.size() - 1;
        index.emplace(std::string_view(owned.back()), id);
        return id;
    }
};

struct Reader {
    dom::parser parser;
    std::vector<char> buf;             // '[' piece ']' and simdjson's padding
    Kind kinds[NKINDS];
    // category -> code (probes.kineto_typed.CATS), looked up by length then bytes: some
    // twenty short strings, cheaper to compare than to hash once per event
    std::vector<std::pair<std::string, int32_t>> cats;
    int32_t cpu_annotation_code = -2;  // "user_annotation": the ranges kept on the CPU side
    std::vector<int8_t> kind_of;       // code -> kind, -1 not kept
    int32_t none_code = -1;            // code of an absent or null "cat"
    std::vector<int64_t> counts;       // events per category code in the last piece
    Table names, jsons;                // names; compact JSON texts of cpu_op arguments
    std::unordered_set<std::string> special;   // operators whose Concrete Inputs are kept (probes.sdpa)
    std::vector<uint8_t> special_id;   // per name id: its name is special
    std::vector<int32_t> specials;     // per special cpu_op row: row, Concrete Inputs id, Input type id
    internal::string_builder<> sb;
    std::string why;                   // what sent the last piece to the reference, or the error
    size_t max_bytes;
    explicit Reader(size_t max) : parser(max + 2), max_bytes(max) {}
};

inline void put(char *row, Slot s, int64_t v) {
    // little-endian hosts only (numpy's "<i8"/"<i4"/"u1" fields): the low bytes
    switch (s.size) {
        case 8: std::memcpy(row + s.off, &v, 8); break;
        case 4: { int32_t x = (int32_t)v; std::memcpy(row + s.off, &x, 4); break; }
        case 1: { int8_t x = (int8_t)v; std::memcpy(row + s.off, &x, 1); break; }
        default: break;
    }
}

// rec.ids32: pid/tid to int32, ids past int32 folded, -1 kept
inline int64_t fold32(int64_t v) { return (v >= -1 && v <= INT32_MAX_) ? v : (v & INT32_MAX_); }

inline bool fits32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX_; }

// a JSON integer within int64 (not a float, bool, string, or an integer past int64)
inline bool int64_of(dom::element v, int64_t &out) {
    return v.type() == dom::element_type::INT64 && !v.get_int64().get(out);
}

// ts/dur in us -> ns as kineto_records.us_value_to_ns; false where the reference would
// give BAD_TIME or the value is not a number (those pieces go to the reference)
inline bool ns_of(dom::element v, int64_t &ns) {
    if (v.type() == dom::element_type::INT64) {
        int64_t i = 0;
        if (v.get_int64().get(i) || i < -TIME_LIMIT_US || i > TIME_LIMIT_US) return false;
        ns = i * 1000;
        return true;
    }
    if (v.type() == dom::element_type::DOUBLE) {
        double d = 0;
        if (v.get_double().get(d) || !(std::fabs(d) <= double(TIME_LIMIT_US))) return false;
        double ip = std::floor(d);
        // np.rint and Python's round(): half to even, the default rounding mode
        ns = (int64_t)ip * 1000 + (int64_t)std::nearbyint((d - ip) * 1000.0);
        return true;
    }
    return false;
}

// pid/tid: an int (folded later), a string ("Spans" rows) -> MISSING; anything else odd
inline bool id_of(dom::element v, int64_t &out) {
    if (v.type() == dom::element_type::STRING) { out = MISSING; return true; }
    return int64_of(v, out);
}

struct Args {
    int64_t device = MISSING, stream = MISSING, context = MISSING, corr = MISSING, ext = MISSING,
            regs = MISSING, shmem = MISSING, bytes = MISSING, cbid = MISSING;
    bool has_device = false, has_stream = false;
    int64_t grid[3] = {MISSING, MISSING, MISSING}, block[3] = {MISSING, MISSING, MISSING};
    dom::element dims, types, concrete;
    bool has_dims = false, has_types = false, has_concrete = false;
};

inline bool xyz_of(dom::element v, int64_t out[3]) {
    dom::array a;
    if (v.get_array().get(a) || a.size() != 3) return false;
    int j = 0;
    for (dom::element e : a)
        if (!int64_of(e, out[j++])) return false;
    return true;
}

// false (and r.why) when an argument the rows keep has a value the reference must read
bool args_of(Reader &r, dom::element v, Args &a) {
    dom::object o;
    if (v.get_object().get(o)) { r.why = "args is not an object"; return false; }
    for (dom::key_value_pair kv : o) {
        std::string_view k = kv.key;
        dom::element x = kv.value;
        int64_t *dst = nullptr;
        switch (k.size()) {
            case 4:
                if (k == "grid") { if (!xyz_of(x, a.grid)) goto odd; continue; }
                if (k == "cbid") dst = &a.cbid;
                break;
            case 5:
                if (k == "block") { if (!xyz_of(x, a.block)) goto odd; continue; }
                if (k == "bytes") dst = &a.bytes;
                break;
            case 6:
                if (k == "device") { dst = &a.device; a.has_device = true; }
                else if (k == "stream") { dst = &a.stream; a.has_stream = true; }
                break;
            case 7:
                if (k == "context") dst = &a.context;
                break;
            case 10:
                if (k == "Input Dims") { a.dims = x; a.has_dims = true; continue; }
                if (k == "Input type") { a.types = x; a.has_types = true; continue; }
                break;
            case 11:
                if (k == "correlation") dst = &a.corr;
                else if (k == "External id") dst = &a.ext;
                break;
            case 13:
                if (k == "shared memory") dst = &a.shmem;
                break;
            case 15:
                if (k == "Concrete Inputs") { a.concrete = x; a.has_concrete = true; continue; }
                break;
            case 20:
                if (k == "registers per thread") dst = &a.regs;
                break;
            default:
                break;
        }
        if (dst && !int64_of(x, *dst)) goto odd;
        continue;
    odd:
        r.why = "args \"" + std::string(k) + "\" is not what Kineto writes";
        return false;
    }
    return true;
}

int32_t json_id(Reader &r, dom::element v) {
    r.sb.clear();
    r.sb.append(v);
    return r.jsons.intern(r.sb.str());
}

// One piece: RJ_OK (rows, counts and names updated), RJ_REFERENCE (r.why: the caller
// reads the piece with the reference builder; rows of this piece dropped).
// ``text`` is the piece; with ``in_place`` its caller promises a writable byte before it
// and one after it, where the brackets go, then SIMDJSON_PADDING readable bytes
// (json_chunks.PIECE_PAD; they are not written): no copy of the piece. Otherwise it is
// copied into r.buf, bracketed.
int piece(Reader &r, char *text, size_t len, bool in_place) {
    for (Kind &k : r.kinds) k.n = 0, k.bad_times = 0;
    r.specials.clear();
    std::fill(r.counts.begin(), r.counts.end(), 0);
    if (len + 2 > r.max_bytes) { r.why = "a piece larger than the reader's capacity"; return RJ_REFERENCE; }
    char *json;
    if (in_place) {
        json = text - 1;
    } else {
        r.buf.resize(len + 2 + SIMDJSON_PADDING);
        json = r.buf.data();
        std::memcpy(json + 1, text, len);
        std::memset(json + len + 2, 0, SIMDJSON_PADDING);
    }
    json[0] = '[';
    json[len + 1] = ']';
    dom::element doc;
    error_code err = r.parser.parse(json, len + 2, false).get(doc);
    if (err) { r.why = std::string("simdjson: ") + error_message(err); return RJ_REFERENCE; }
    dom::array arr;
    if (doc.get_array().get(arr)) { r.why = "not an array"; return RJ_REFERENCE; }
    for (dom::element el : arr) {
        dom::object obj;
        if (el.get_object().get(obj)) { r.why = "an element is not an object"; return RJ_REFERENCE; }
        std::string_view name;
        bool has_name = false, has_ts = false, has_dur = false, has_pid = false, has_tid = false,
             has_args = false, is_x = false;
        int32_t code = r.none_code;
        dom::element ts, dur, pid, tid, args, namev;
        for (dom::key_value_pair kv : obj) {
            std::string_view k = kv.key;
            dom::element v = kv.value;
            switch (k.size()) {
                case 2:
                    if (k == "ph") {
                        std::string_view s;
                        if (!v.get_string().get(s)) is_x = s == "X";
                        else if (v.is_null()) is_x = false;
                        else { r.why = "ph is not a string"; return RJ_REFERENCE; }
                    } else if (k == "ts") { ts = v; has_ts = true; }
                    break;
                case 3:
                    if (k == "cat") {
                        std::string_view s;
                        if (!v.get_string().get(s)) {
                            code = -1;
                            for (const auto &c : r.cats)
                                if (c.first.size() == s.size() && std::memcmp(c.first.data(), s.data(), s.size()) == 0) {
                                    code = c.second;
                                    break;
                                }
                            if (code < 0) { r.why = "a category this reader does not know"; return RJ_REFERENCE; }
                        } else if (v.is_null()) {
                            code = r.none_code;
                        } else { r.why = "cat is not a string"; return RJ_REFERENCE; }
                    } else if (k == "dur") { dur = v; has_dur = true; }
                    else if (k == "pid") { pid = v; has_pid = true; }
                    else if (k == "tid") { tid = v; has_tid = true; }
                    break;
                case 4:
                    if (k == "name") { namev = v; has_name = true; }
                    else if (k == "args") { args = v; has_args = true; }
                    break;
                default:
                    break;
            }
        }
        r.counts[code]++;
        int kind = is_x ? r.kind_of[code] : -1;
        if (kind < 0) continue;
        // a kept event: every field it keeps read exactly, or the piece goes to the reference
        int64_t start = 0, d = 0, p = MISSING, t = MISSING;
        if (!has_ts || !ns_of(ts, start)) { r.why = "ts missing or not a number within +-2^62 ns"; return RJ_REFERENCE; }
        if (has_dur && !ns_of(dur, d)) { r.why = "dur not a number within +-2^62 ns"; return RJ_REFERENCE; }
        if ((has_pid && !id_of(pid, p)) || (has_tid && !id_of(tid, t))) { r.why = "pid/tid neither int nor string"; return RJ_REFERENCE; }
        int32_t nid = (int32_t)MISSING;
        if (has_name) {
            if (!namev.get_string().get(name)) {
                nid = r.names.intern(name);
                if ((size_t)nid >= r.special_id.size()) {   // a new name: special or not, once
                    r.special_id.resize(nid + 1, 0);
                    r.special_id[nid] = r.special.count(std::string(name)) != 0;
                }
            }
            else if (!namev.is_null()) { r.why = "name is not a string"; return RJ_REFERENCE; }
        }
        Args a;
        if (has_args && !args_of(r, args, a)) return RJ_REFERENCE;
        Kind &K = r.kinds[kind];
        size_t need = (K.n + 1) * (size_t)K.itemsize;
        if (K.rows.size() < need) K.rows.resize(need < 4096 ? 4096 : 2 * need);
        char *row = K.rows.data() + K.n * K.itemsize;
        std::memcpy(row, K.tmpl.data(), K.itemsize);
        const Slot *s = K.slot;
        put(row, s[F_START], start);
        put(row, s[F_END], start + d);     // no overflow: |start|, |d| <= TIME_LIMIT_US * 1000 < 2^62
        // ns_of has bounded |start| by TIME_LIMIT_US * 1000 <= TIME_LIMIT_NS already, so with
        // d >= 0 only the end can pass the limit (kineto_records.reject_invalid_times' rule)
        if (d < 0 || start + d > TIME_LIMIT_NS)
            K.bad_times++;
        put(row, s[F_NAME], nid);
        put(row, s[F_CAT], code);
        put(row, s[F_EXT], a.ext);
        switch (kind) {
            case K_KERNELS:
                if (!fits32(a.device) || !fits32(a.context) || !fits32(a.regs) || !fits32(a.shmem)) goto narrow;
                for (int j = 0; j < 3; j++)
                    if (!fits32(a.grid[j]) || !fits32(a.block[j])) goto narrow;
                put(row, s[F_DEVICE], a.device);
                put(row, s[F_STREAM], a.stream);
                put(row, s[F_CONTEXT], a.context);
                put(row, s[F_CORR], a.corr);
                put(row, s[F_REGS], a.regs);
                put(row, s[F_SHMEM], a.shmem);
                put(row, s[F_GX], a.grid[0]); put(row, s[F_GY], a.grid[1]); put(row, s[F_GZ], a.grid[2]);
                put(row, s[F_BX], a.block[0]); put(row, s[F_BY], a.block[1]); put(row, s[F_BZ], a.block[2]);
                break;
            case K_COPIES:
                if (!fits32(a.device)) goto narrow;
                put(row, s[F_DEVICE], a.device);
                put(row, s[F_STREAM], a.stream);
                put(row, s[F_CORR], a.corr);
                put(row, s[F_BYTES], a.bytes);
                break;
            case K_API:
                if (!fits32(a.cbid)) goto narrow;
                put(row, s[F_PID], fold32(p));
                put(row, s[F_TID], fold32(t));
                put(row, s[F_CORR], a.corr);
                put(row, s[F_CBID], a.cbid);
                break;
            case K_RANGES: {
                // kineto_typed._rows: CPU-side annotations keep pid/tid; GPU-side ones (and
                // cuda_sync) put the device (else the pid) and the stream (else the tid)
                bool cpu_side = code == r.cpu_annotation_code;
                put(row, s[F_PID], cpu_side ? fold32(p) : MISSING);
                put(row, s[F_TID], fold32(cpu_side || !a.has_stream ? t : a.stream));
                put(row, s[F_DEVICE], cpu_side ? MISSING : fold32(a.has_device ? a.device : p));
                break;
            }
            case K_CPU_OPS: {
                put(row, s[F_PID], fold32(p));
                put(row, s[F_TID], fold32(t));
                int32_t dims = a.has_dims ? json_id(r, a.dims) : (int32_t)MISSING;
                int32_t types = a.has_types ? json_id(r, a.types) : (int32_t)MISSING;
                put(row, s[F_IN_DIMS], dims);
                put(row, s[F_IN_TYPES], types);
                if (nid >= 0 && r.special_id[nid]) {
                    r.specials.push_back((int32_t)K.n);
                    r.specials.push_back(a.has_concrete ? json_id(r, a.concrete) : (int32_t)MISSING);
                    r.specials.push_back(types);
                }
                break;
            }
        }
        K.n++;
        continue;
    narrow:
        r.why = "an argument does not fit its int32 column";
        return RJ_REFERENCE;
    }
    return RJ_OK;
}

thread_local std::string last_error;

}  // namespace

extern "C" {

// The readable bytes a piece parsed in place needs after its closing bracket: checked
// against json_chunks.PIECE_PAD when the library is loaded (probes/kineto_native.py).
__attribute__((visibility("default"))) size_t rj_padding(void) { return SIMDJSON_PADDING; }

__attribute__((visibility("default"))) void *rj_new(size_t max_bytes) {
    try {
        Reader *r = new Reader(max_bytes);
        if (r->parser.allocate(0, MAX_DEPTH) != SUCCESS) { delete r; return nullptr; }
        return r;
    } catch (const std::exception &e) {
        last_error = e.what();
        return nullptr;
    }
}

__attribute__((visibility("default"))) void rj_free(void *h) { delete static_cast<Reader *>(h); }

// The layout of kind k's rows: itemsize, one row of defaults (tmpl), and per Field an
// (offset, size) pair (size 0: absent from the dtype; sizes 1, 4, 8).
__attribute__((visibility("default"))) int rj_kind(void *h, int k, int itemsize, const char *tmpl,
                                                   const int32_t *slots) {
    if (k < 0 || k >= NKINDS || itemsize <= 0) return RJ_ERROR;
    Reader &r = *static_cast<Reader *>(h);
    try {
        Kind &K = r.kinds[k];
        K.itemsize = itemsize;
        K.tmpl.assign(tmpl, tmpl + itemsize);
        for (int f = 0; f < NFIELDS; f++) {
            Slot s{slots[2 * f], slots[2 * f + 1]};
            if (s.size != 0 && s.size != 1 && s.size != 4 && s.size != 8) return RJ_ERROR;
            if (s.size && (s.off < 0 || s.off + s.size > itemsize)) return RJ_ERROR;
            K.slot[f] = s;
        }
    } catch (const std::bad_alloc &) {
        return RJ_ERROR;
    }
    return RJ_OK;
}

// Category ``name`` has code ``code`` and rows of kind ``kind`` (-1: counted only);
// ``name`` NULL: the code of an absent or null category.
__attribute__((visibility("default"))) int rj_category(void *h, const char *name, int code, int kind) {
    Reader &r = *static_cast<Reader *>(h);
    if (code < 0 || code > 1000 || kind < -1 || kind >= NKINDS) return RJ_ERROR;
    try {
        if ((size_t)code >= r.kind_of.size()) { r.kind_of.resize(code + 1, -1); r.counts.resize(code + 1, 0); }
        r.kind_of[code] = (int8_t)kind;
        if (name) {
            r.cats.emplace_back(name, code);
            if (r.cats.back().first == "user_annotation") r.cpu_annotation_code = code;
        } else {
            r.none_code = code;
        }
    } catch (const std::bad_alloc &) {
        return RJ_ERROR;
    }
    return RJ_OK;
}

__attribute__((visibility("default"))) int rj_special(void *h, const char *name) {
    try {
        static_cast<Reader *>(h)->special.insert(name);
    } catch (const std::bad_alloc &) {
        return RJ_ERROR;
    }
    return RJ_OK;
}

// in_place != 0: see piece() (the caller's buffer is written to, around the piece)
__attribute__((visibility("default"))) int rj_piece(void *h, char *text, size_t len, int in_place) {
    Reader &r = *static_cast<Reader *>(h);
    if (r.none_code < 0) { r.why = "categories not configured"; return RJ_ERROR; }
    try {
        return piece(r, text, len, in_place != 0);
    } catch (const std::bad_alloc &) {
        r.why = "out of memory";
        return RJ_ERROR;
    } catch (const std::exception &e) {   // std::length_error and the like: nothing simdjson throws here
        r.why = e.what();
        return RJ_ERROR;
    }
}

__attribute__((visibility("default"))) const char *rj_why(void *h) {
    return h ? static_cast<Reader *>(h)->why.c_str() : last_error.c_str();
}

__attribute__((visibility("default"))) long rj_rows(void *h, int k, char **rows) {
    Reader &r = *static_cast<Reader *>(h);
    if (k < 0 || k >= NKINDS) return -1;
    *rows = r.kinds[k].rows.data();
    return (long)r.kinds[k].n;
}

// Rows of the last piece, all kinds, that kineto_records.reject_invalid_times would drop
// (0: it has nothing to do for them).
__attribute__((visibility("default"))) long rj_bad_times(void *h) {
    const Reader &r = *static_cast<Reader *>(h);
    long n = 0;
    for (const Kind &k : r.kinds) n += (long)k.bad_times;
    return n;
}

__attribute__((visibility("default"))) const int64_t *rj_counts(void *h, long *n) {
    Reader &r = *static_cast<Reader *>(h);
    *n = (long)r.counts.size();
    return r.counts.data();
}

__attribute__((visibility("default"))) const int32_t *rj_specials(void *h, long *n) {
    Reader &r = *static_cast<Reader *>(h);
    *n = (long)r.specials.size() / 3;
    return r.specials.data();
}

// table 0: names, 1: compact JSON texts. rj_count: how many; rj_text: the i-th (its bytes
// in *len; UTF-8, simdjson validated it)
__attribute__((visibility("default"))) long rj_count(void *h, int table) {
    Reader &r = *static_cast<Reader *>(h);
    return (long)(table ? r.jsons : r.names).owned.size();
}

__attribute__((visibility("default"))) const char *rj_text(void *h, int table, long i, size_t *len) {
    Reader &r = *static_cast<Reader *>(h);
    Table &t = table ? r.jsons : r.names;
    if (i < 0 || (size_t)i >= t.owned.size()) { *len = 0; return nullptr; }
    *len = t.owned[i].size();
    return t.owned[i].data();
}

}  // extern "C"

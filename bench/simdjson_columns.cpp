// Candidate for issue 21.2, measured by bench/bench_json_readers.py (not part of the package):
// Kineto events -> columns with simdjson's on-demand API, no object per event.
//
// One call per piece of whole events (the JSON text of a `[...]` array, padded with
// SIMDJSON_PADDING bytes). For every event it writes one row: category code, phase
// "X" or not, name id (names interned in a table kept across calls), ts/dur in ns
// (the float rule of probes.kineto_records.us_to_ns: integer part * 1000 + rounded fraction),
// pid, tid and the args the kernel/copy/runtime rows keep. Fields absent stay at -1.
// This is the work a native reader does per event; the bench compares its time with
// ISA-L's inflate of the same bytes and with the Python candidates.
//
//   g++ -O3 -shared -fPIC bench/simdjson_columns.cpp -lsimdjson -o /tmp/libsimdjson_columns.so
#include <simdjson.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>

using namespace simdjson;

namespace {
ondemand::parser parser;
// names interned once: the map's keys view strings kept in `owned` (a deque never moves
// them), so a name seen before costs one hash of its raw bytes and no allocation
std::deque<std::string> owned;
std::unordered_map<std::string_view, int32_t> names;

int32_t intern(std::string_view s) {
    auto it = names.find(s);
    if (it != names.end()) return it->second;
    owned.emplace_back(s);
    int32_t id = (int32_t)names.size();
    names.emplace(std::string_view(owned.back()), id);
    return id;
}

const char *const CATS[] = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver",
                            "cpu_op", "user_annotation", "gpu_user_annotation", "cuda_sync"};
constexpr int NCATS = sizeof(CATS) / sizeof(CATS[0]);

int cat_code(std::string_view c) {
    for (int i = 0; i < NCATS; i++)
        if (c == CATS[i]) return i;
    return NCATS;   // another category: counted, no row
}

int64_t us_to_ns(double v) {
    double ip = std::floor(v);
    return (int64_t)ip * 1000 + (int64_t)std::nearbyint((v - ip) * 1000.0);
}

int64_t num_ns(ondemand::value v) {
    ondemand::number_type t;
    if (v.get_number_type().get(t)) return -1;
    if (t == ondemand::number_type::floating_point_number) return us_to_ns(double(v.get_double()));
    int64_t i;
    if (v.get_int64().get(i)) return -1;
    return i * 1000;
}

int64_t as_int(ondemand::value v) {
    int64_t i;
    if (v.get_int64().get(i)) return -1;
    return i;
}
}  // namespace

extern "C" {
// Columns (each of capacity `cap` rows; 8 int64 per row in `ints`: ts_ns, end_ns, device,
// stream, correlation, external_id, bytes, pid; 6 in `dims`: grid xyz, block xyz), `cat` and
// `name_id` int32. Returns the rows written, -1 on a JSON error, -2 when cap is too small.
long columns(const char *buf, size_t len, size_t cap, int32_t *cat, int32_t *name_id, int64_t *ints,
             int64_t *dims) {
    ondemand::document doc;
    if (parser.iterate(buf, len, len + SIMDJSON_PADDING).get(doc)) return -1;
    ondemand::array arr;
    if (doc.get_array().get(arr)) return -1;
    size_t n = 0;
    for (auto el : arr) {
        ondemand::object obj;
        if (el.get_object().get(obj)) return -1;
        if (n >= cap) return -2;
        int64_t *row = ints + 8 * n, *d = dims + 6 * n;
        for (int k = 0; k < 8; k++) row[k] = -1;
        for (int k = 0; k < 6; k++) d[k] = -1;
        int c = NCATS + 1, x = 0;
        int32_t nid = -1;
        int64_t dur = 0;
        for (auto field : obj) {
            // the key's raw text (no unescaping, no copy): Kineto's keys hold no escapes
            ondemand::raw_json_string rk;
            if (field.key().get(rk)) return -1;
            std::string_view key(rk.raw(), std::strchr(rk.raw(), '"') - rk.raw());
            ondemand::value v = field.value();
            if (key == "ph") {
                std::string_view s;
                x = !v.get_string().get(s) && s == "X";
            } else if (key == "cat") {
                std::string_view s;
                if (!v.get_string().get(s)) c = cat_code(s);
            } else if (key == "name") {
                std::string_view s;
                if (!v.get_string().get(s)) nid = intern(s);
            } else if (key == "ts") {
                row[0] = num_ns(v);
            } else if (key == "dur") {
                dur = num_ns(v);
            } else if (key == "pid") {
                row[7] = as_int(v);
            } else if (key == "args") {
                ondemand::object a;
                if (v.get_object().get(a)) continue;
                for (auto af : a) {
                    ondemand::raw_json_string rak;
                    if (af.key().get(rak)) return -1;
                    std::string_view ak(rak.raw(), std::strchr(rak.raw(), '"') - rak.raw());
                    ondemand::value av = af.value();
                    if (ak == "device") row[2] = as_int(av);
                    else if (ak == "stream") row[3] = as_int(av);
                    else if (ak == "correlation") row[4] = as_int(av);
                    else if (ak == "External id") row[5] = as_int(av);
                    else if (ak == "bytes") row[6] = as_int(av);
                    else if (ak == "grid" || ak == "block") {
                        ondemand::array xyz;
                        if (av.get_array().get(xyz)) continue;
                        int64_t *out = d + (ak == "grid" ? 0 : 3);
                        int j = 0;
                        for (auto e : xyz) {
                            if (j < 3) out[j] = as_int(e.value());
                            j++;
                        }
                    }
                }
            }
        }
        row[1] = row[0] + dur;
        cat[n] = x ? c : -1 - c;
        name_id[n] = nid;
        n++;
    }
    return (long)n;
}

long name_count() { return (long)names.size(); }
}

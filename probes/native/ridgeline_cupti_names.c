/* Name interning: the kernel and marker name pointers of records, copied once each and
 * sent to the agent by id.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* ------------------------------------------------------------------------------------ */
/* interned names (kernel names, NVTX names and domains: CUPTI-owned memory)             */

int names_alloc(void) {
    g_names_max = (uint32_t)env_long("RIDGELINE_MAX_NAMES", 65536, 16, RL_MAX_NAMES);
    g_names_cap = 1;
    while (g_names_cap < g_names_max * 2) g_names_cap <<= 1;
    g_names = calloc(g_names_cap, sizeof *g_names);
    g_name_order = calloc(g_names_max, sizeof *g_name_order);
    g_strings_max = (size_t)env_long("RIDGELINE_MAX_NAME_BYTES", 16 << 20, 4096, RL_MAX_NAME_BYTES_TOTAL);
    g_strings_cap = 256 << 10;
    g_strings = malloc(g_strings_cap);
    return g_names && g_name_order && g_strings ? 0 : -1;
}

/* A name longer than RL_NAME_MAX_LEN (the agent's limit; C++ template instantiations get
 * there) is cut, and the cut one ends in "#" + 16 hex digits of a hash of the whole
 * name, so two kernels that differ only past the cut stay two names. Returns the length
 * written to out, or 0 when the name fits as it is. */
static size_t long_name(const char *s, char out[RL_NAME_MAX_LEN]) {
    if (strnlen(s, RL_NAME_MAX_LEN + 1) <= RL_NAME_MAX_LEN) return 0;
    uint64_t h = 1469598103934665603ull; /* FNV-1a 64 */
    for (size_t i = 0; i < RL_NAME_HASH_MAX && s[i]; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    const size_t keep = RL_NAME_MAX_LEN - 17;
    memcpy(out, s, keep);
    char tail[18];
    snprintf(tail, sizeof tail, "#%016llx", (unsigned long long)h);
    memcpy(out + keep, tail, 17);
    return RL_NAME_MAX_LEN;
}

/* Caller holds g_names_lock. */
/* A name not seen before, at its free hash slot h (intern_ptr found it). */
void intern_new(uintptr_t ptr, uint32_t h) {
    if (g_names_count >= g_names_max) {
        atomic_fetch_add(&K.names_dropped, 1);
        return;
    }
    const char *s = (const char *)ptr;
    char cut[RL_NAME_MAX_LEN];
    size_t len = long_name(s, cut);
    if (len) s = cut;
    else len = strnlen(s, RL_NAME_MAX_LEN);
    if (g_strings_used + len > g_strings_cap) {
        size_t want = g_strings_cap;
        while (want < g_strings_used + len) want *= 2;
        if (want > g_strings_max) {
            atomic_fetch_add(&K.names_dropped, 1);
            return;
        }
        char *n = realloc(g_strings, want);
        if (!n) {
            atomic_fetch_add(&K.names_dropped, 1);
            return;
        }
        g_strings = n;
        g_strings_cap = want;
    }
    memcpy(g_strings + g_strings_used, s, len);
    g_names[h].ptr = ptr;
    g_names[h].off = (uint32_t)g_strings_used;
    g_names[h].len = (uint32_t)len;
    g_strings_used += len;
    g_name_order[g_names_count++] = h;
}

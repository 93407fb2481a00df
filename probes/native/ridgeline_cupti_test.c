/* Test entry points (ridgeline_test_*): drive the buffer path without a GPU
 * (tests/test_native_cupti*.py through tests/support/native_harness.py). Built into the test library
 * build/libridgeline_cupti_test.so only, never into the shipped libridgeline_cupti.so.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* the kernel record sizes the build knows (as ridgeline_cupti_pool.c reads them) */
static const uint32_t RL_KERNEL_SIZES[] = RL_KERNEL_KNOWN_SIZES;

/* ---- test entry points: drive the buffer path without a GPU (tests/test_native_cupti.py) ---- */

/* Sets the library up as if CUPTI were there (record sizes from the compiled-in headers)
 * and starts the sender. socket_path NULL keeps RIDGELINE_SOCKET / the default. */
/* The tail of both test entry points: test mode on, the sender running. */
static int test_mode_start(void) {
    g_test_mode = 1;
    atomic_fetch_or(&g_flags, RL_FLAG_TEST_MODE);
    g_init_pid = getpid();
    pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    atomic_store(&g_active, 1);
    start_sender_if_needed();
    return 0;
}

RL_EXPORT int ridgeline_test_init(const char *socket_path, uint32_t cupti_version) {
    if (atomic_exchange(&g_initialized, 1)) return -1;
    if (common_init()) return -1;
    if (socket_path) set_socket_path(socket_path);
    g_cupti_version = cupti_version;
    sizes_from_header();
    return test_mode_start();
}

/* As ridgeline_test_init, but with a real libcupti loaded from libcupti_path: the record
 * sizes are then decided as in a served process (cuptiActivityGetStructSize, or walking
 * with that libcupti's own cuptiActivityGetNextRecord). Nothing is subscribed or enabled.
 * Returns 0, or -2 (cannot load), -3 (entry points missing), -4 (cuptiGetVersion failed,
 * e.g. no driver), the reason in the status lines. */
RL_EXPORT int ridgeline_test_init_cupti(const char *socket_path, const char *libcupti_path) {
    if (atomic_exchange(&g_initialized, 1)) return -1;
    if (common_init()) return -1;
    if (socket_path) set_socket_path(socket_path);
    char why[2048] = {0};
    if (!(C.lib = dlopen(libcupti_path, RTLD_NOW | RTLD_LOCAL))) {
        rl_log("cannot load %s: %s", libcupti_path, dlerror());
        return -2;
    }
    if (resolve_cupti(why, sizeof why)) {
        rl_log("%s", why);
        return -3;
    }
    CUptiResult r = C.GetVersion(&g_cupti_version);
    if (r != CUPTI_SUCCESS) {
        rl_log("cuptiGetVersion failed: %s (%d)", cupti_err(r), (int)r);
        return -4;
    }
    sizes_for_runtime(g_cupti_version);
    return test_mode_start();
}

/* Exactly what CUPTI's completed-buffer callback does with a buffer (the buffer stays the caller's). */
RL_EXPORT void ridgeline_test_buffer_completed(uint8_t *buffer, size_t valid_size) { process_buffer(buffer, valid_size); }

/* Counters, in this order: dropped_cupti, dropped_pool_full, dropped_no_agent, dropped_send,
 * sampled_out, names_dropped, walk_errors, records_in, records_sent, batches_sent, connects,
 * buffers_refused, mode, flags, kernel_sample_every, buffers_lost, flushes, takeovers, reclaims,
 * clock_mapped, clock_unmapped, guest_sessions, guest_records, guest_buffers, guest_dropped, clock_pairs,
 * connects_busy. Returns how many were written. */
RL_EXPORT int ridgeline_test_counters(uint64_t *out, int n) {
    uint64_t v[] = {atomic_load(&K.dropped_cupti), atomic_load(&K.dropped_pool_full), atomic_load(&K.dropped_no_agent),
                    atomic_load(&K.dropped_send), atomic_load(&K.sampled_out), atomic_load(&K.names_dropped),
                    atomic_load(&K.walk_errors), atomic_load(&K.records_in), atomic_load(&K.records_sent),
                    atomic_load(&K.batches_sent), atomic_load(&K.connects), atomic_load(&K.buffers_refused),
                    (uint64_t)atomic_load(&g_mode), atomic_load(&g_flags), atomic_load(&g_sample_every),
                    atomic_load(&K.buffers_lost), atomic_load(&K.flushes), atomic_load(&K.takeovers),
                    atomic_load(&K.reclaims), atomic_load(&g_clock_mapped), atomic_load(&g_clock_unmapped),
                    atomic_load(&g_guest_sessions), atomic_load(&g_guest_records), atomic_load(&g_guest_buffers),
                    atomic_load(&g_guest_dropped), atomic_load(&g_clock_pairs), atomic_load(&K.connects_busy)};
    int m = (int)(sizeof v / sizeof v[0]);
    if (n < m) m = n;
    for (int i = 0; i < m; i++) out[i] = v[i];
    return m;
}

/* 1 when every pool slot is free (all handed to the sender and sent or dropped). */
RL_EXPORT int ridgeline_test_pool_idle(void) {
    int busy = 0;
    pthread_mutex_lock(&g_pool_lock);
    for (unsigned i = 0; g_slots && i < cfg.pool_slots; i++) busy |= g_slots[i].state != SLOT_FREE;
    pthread_mutex_unlock(&g_pool_lock);
    return !busy;
}

/* The status lines (the reasons logged so far). */
RL_EXPORT size_t ridgeline_test_status(char *out, size_t cap) {
    pthread_mutex_lock(&g_status_lock);
    size_t n = strlen(g_status);
    if (cap) {
        size_t c = n < cap - 1 ? n : cap - 1;
        memcpy(out, g_status, c);
        out[c] = 0;
    }
    pthread_mutex_unlock(&g_status_lock);
    return n;
}

/* The record layout and size bounds the library relies on, by name, for
 * tests/test_native_cupti_headers.py to check against each real header set; -1 if unknown.
 * "kernel.known_size.N" is the N-th kernel record size whose name is read (0 past the end). */
RL_EXPORT long ridgeline_test_layout(const char *what) {
    static const struct { const char *n; long v; } T[] = {
        {"kind", RL_REC_OFF_KIND},
        {"kernel.name", RL_KERNEL_OFF_NAME},
        {"kernel.deviceId", RL_KERNEL_OFF_DEVICE_ID},
        {"memcpy.deviceId", RL_MEMCPY_OFF_DEVICE_ID},
        {"memset.deviceId", RL_MEMSET_OFF_DEVICE_ID},
        {"marker.name", RL_MARKER_OFF_NAME},
        {"marker.domain", RL_MARKER_OFF_DOMAIN},
        {"marker.size", RL_MARKER_MIN_SIZE},
        {"max_body_bytes", RL_MAX_BODY_BYTES},
        {"max_buffer_bytes", RL_MAX_BUFFER_BYTES},
        {"header_api_version", CUPTI_API_VERSION},
    };
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++)
        if (!strcmp(what, T[i].n)) return T[i].v;
    if (!strncmp(what, "kernel.known_size.", 18)) {
        long i = atol(what + 18);
        return i >= 0 && i < (long)(sizeof RL_KERNEL_SIZES / sizeof RL_KERNEL_SIZES[0]) ? (long)RL_KERNEL_SIZES[i] : 0;
    }
    if (!strcmp(what, "buffer_bytes")) return (long)cfg.buffer_bytes;
    if (!strcmp(what, "pool_slots")) return (long)cfg.pool_slots;
    if (!strcmp(what, "max_cupti_buffers")) return (long)cfg.max_cupti_buffers;
    if (!strcmp(what, "socket_path_len")) return (long)strlen(cfg.socket_path);
    return -1;
}

/* The compiled-in injection policy and the sinks handed out (tests). */
RL_EXPORT const char *ridgeline_test_skip_default(void) { return rl_default_skip; }
RL_EXPORT uint64_t ridgeline_test_sinks_handed(void) { return atomic_load(&g_sinks_handed); }

/* Record sizes the library uses, for the agent-side cross-check in tests. */
RL_EXPORT uint32_t ridgeline_test_record_size(uint32_t kind) { return kind < RL_KIND_MAX ? g_rec_size[kind] : 0; }

RL_EXPORT void ridgeline_test_shutdown(void) {
    if (!atomic_load(&g_sender_running)) return;
    atomic_store(&g_stop, 1);
    pthread_mutex_lock(&g_pool_lock);
    pthread_cond_broadcast(&g_pool_cond);
    pthread_mutex_unlock(&g_pool_lock);
    pthread_join(g_sender, NULL);
    atomic_store(&g_sender_running, 0);
}

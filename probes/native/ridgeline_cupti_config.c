/* Configuration (the environment, read once), logging and the status text sent in HELLO.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* ------------------------------------------------------------------------------------ */
/* configuration (environment, read once)                                               */

struct rl_config cfg;

/* ------------------------------------------------------------------------------------ */
/* logging and status                                                                    */

void rl_log(const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    /* The status text travels to the agent in HELLO; stderr is for the operator. */
    pthread_mutex_lock(&g_status_lock);
    size_t used = strlen(g_status), n = strlen(line);
    /* full: the oldest lines make room (a long-running process keeps its latest state) */
    while (used && used + n + 2 >= sizeof g_status) {
        char *nl = strchr(g_status, '\n');
        size_t drop = nl ? (size_t)(nl - g_status) + 1 : used;
        memmove(g_status, g_status + drop, used - drop + 1);
        used -= drop;
    }
    if (used + n + 2 < sizeof g_status) {
        memcpy(g_status + used, line, n);
        g_status[used + n] = '\n';
        g_status[used + n + 1] = 0;
    }
    pthread_mutex_unlock(&g_status_lock);
    atomic_fetch_add(&g_status_gen, 1); /* the sender sends a fresh HELLO */
    if (!cfg.quiet) {
        char out[560];
        int n = snprintf(out, sizeof out, "ridgeline-cupti[%d]: %s\n", (int)getpid(), line);
        if (n > 0) {
            ssize_t w = write(2, out, (size_t)n < sizeof out ? (size_t)n : sizeof out - 1);
            (void)w;
        }
    }
}

const char *cupti_err(CUptiResult r) {
    const char *s = NULL;
    if (C.GetResultString && C.GetResultString(r, &s) == CUPTI_SUCCESS && s) return s;
    return "unknown CUPTI error";
}

uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

long env_long(const char *name, long dflt, long lo, long hi) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) return dflt;
    return x;
}

/* A unix socket path must fit sun_path (107 bytes and the NUL). A longer one is refused
 * with a logged reason: cutting it would connect to some other path. */
void set_socket_path(const char *p) {
    if (strlen(p) >= sizeof cfg.socket_path) {
        cfg.socket_path[0] = 0;
        rl_log("socket path %.60s... is %zu bytes, over the %zu-byte limit of a unix socket path: "
               "records will not be sent (set RIDGELINE_SOCKET to a shorter path)",
               p, strlen(p), sizeof cfg.socket_path - 1);
        return;
    }
    snprintf(cfg.socket_path, sizeof cfg.socket_path, "%s", p);
}

void read_config(void) {
    cfg.quiet = (int)env_long("RIDGELINE_QUIET", 0, 0, 1);
    const char *p = getenv("RIDGELINE_SOCKET");
    set_socket_path((p && *p) ? p : "/run/ridgeline/cupti.sock");
    /* Each buffer becomes one BATCH body, which the agent accepts only up to
     * RL_MAX_BODY_BYTES: a larger setting is lowered to RL_MAX_BUFFER_BYTES, not ignored. */
    long want = env_long("RIDGELINE_BUFFER_BYTES", 4 << 20, 64 << 10, LONG_MAX);
    if (want > (long)RL_MAX_BUFFER_BYTES) {
        rl_log("RIDGELINE_BUFFER_BYTES=%ld is over the %u-byte maximum the agent accepts; using %u", want,
               (unsigned)RL_MAX_BUFFER_BYTES, (unsigned)RL_MAX_BUFFER_BYTES);
        want = RL_MAX_BUFFER_BYTES;
    }
    cfg.buffer_bytes = (size_t)want & ~(size_t)7;
    cfg.pool_slots = (unsigned)env_long("RIDGELINE_POOL_SLOTS", 8, 1, 1024);
    cfg.max_cupti_buffers = (unsigned)env_long("RIDGELINE_MAX_CUPTI_BUFFERS", 32, 2, 4096);
    /* Each setting has its own range, but their products are what the served process
     * holds: bound those too (settings within reach of the defaults are untouched). */
    size_t slots_max = RL_MAX_POOL_BYTES / cfg.buffer_bytes, bufs_max = RL_MAX_CUPTI_BYTES / cfg.buffer_bytes;
    if (slots_max < 1) slots_max = 1;
    if (bufs_max < 2) bufs_max = 2;
    if (cfg.pool_slots > slots_max) {
        rl_log("RIDGELINE_POOL_SLOTS=%u of %zu-byte buffers is over the %llu MiB bound of the record pool; using %zu",
               cfg.pool_slots, cfg.buffer_bytes, (unsigned long long)(RL_MAX_POOL_BYTES >> 20), slots_max);
        cfg.pool_slots = (unsigned)slots_max;
    }
    if (cfg.max_cupti_buffers > bufs_max) {
        rl_log("RIDGELINE_MAX_CUPTI_BUFFERS=%u of %zu-byte buffers is over the %llu MiB bound of CUPTI's buffers; "
               "using %zu", cfg.max_cupti_buffers, cfg.buffer_bytes, (unsigned long long)(RL_MAX_CUPTI_BYTES >> 20),
               bufs_max);
        cfg.max_cupti_buffers = (unsigned)bufs_max;
    }
    cfg.flush_ms = (unsigned)env_long("RIDGELINE_FLUSH_MS", 500, 0, 60000);
    cfg.reconnect_ms = (unsigned)env_long("RIDGELINE_RECONNECT_MS", 1000, 10, 600000);
    cfg.stall_ms = (unsigned)env_long("RIDGELINE_STALL_MS", 2000, 10, 600000);
    cfg.graph_level = (int)env_long("RIDGELINE_GRAPH_LEVEL", 0, 0, 1);
    const char *m = getenv("RIDGELINE_MODE");
    cfg.initial_mode = (m && (!strcmp(m, "deep") || !strcmp(m, "deep-dive"))) ? RL_MODE_DEEP : RL_MODE_ALWAYS_ON;
    cfg.kernel_sample_every = (unsigned)env_long("RIDGELINE_KERNEL_SAMPLE_EVERY", 1, 1, 1000000);
    cfg.exit_flush = (int)env_long("RIDGELINE_EXIT_FLUSH", 1, 0, 1);
    cfg.sigterm_flush = (int)env_long("RIDGELINE_SIGTERM_FLUSH", 1, 0, 1);
    cfg.stop_flush_ms = (unsigned)env_long("RIDGELINE_STOP_FLUSH_MS", 500, 10, 5000);
    /* CUPTI's default is 250 device buffers per context of 3.2 MB each (CUDA 12.4..13.5
     * headers, CUPTI_ACTIVITY_ATTR_DEVICE_BUFFER_POOL_LIMIT / _DEVICE_BUFFER_SIZE), allocated
     * on the application's thread as load grows: up to 800 MB of device memory per context
     * that vLLM did not count when it sized its KV cache. 8 buffers (25.6 MB) hold 800k
     * records, 1.6M records/s at the 500 ms flush; past them CUPTI drops and counts. */
    cfg.device_buffer_pool_limit = (unsigned)env_long("RIDGELINE_DEVICE_BUFFER_POOL_LIMIT", 8, 0, 250);
}

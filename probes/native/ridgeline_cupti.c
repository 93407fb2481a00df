/* libridgeline_cupti.so: CUPTI injection library for Ridgeline.
 *
 * Loaded by the CUDA driver from CUDA_INJECTION64_PATH at cuInit, which calls
 * InitializeInjection(). It collects CUPTI activity records and ships them, raw, to
 * the Ridgeline agent over a local unix socket. The agent decodes them (probes/cupti).
 *
 * Rules this file keeps (the served process must never be endangered):
 *  - libcupti is dlopen'ed, never linked: a missing or unusable libcupti/driver logs
 *    one clear line and the application runs on untouched.
 *  - CUPTI's buffer callbacks only copy and return. They never call Python, never
 *    block on I/O, never call back into CUPTI's flush. A bounded pool takes the copy;
 *    when it is full the buffer is dropped and counted.
 *  - One sender thread of our own does all socket work with non-blocking calls;
 *    an absent, slow or restarting agent costs dropped (and counted) records, never
 *    a stall. It reconnects on its own.
 *  - No cuptiFinalize (a shared process may have other CUPTI users; finalize poisons
 *    CUPTI for the rest of the process). Another subscriber (torch.profiler, Nsight)
 *    is detected and reported; we then stay passive instead of stealing its callbacks.
 *    One that takes CUPTI over later on a legacy CUPTI is detected from the sender
 *    thread, reported, and collection resumes when CUPTI shows it is done.
 *  - Builds with the CUPTI headers of CUDA 12.x and 13.x: fields are read at the fixed
 *    offsets of ridgeline_cupti_abi.h, record sizes come from the libcupti loaded.
 *  - The sender flushes CUPTI periodically (RIDGELINE_FLUSH_MS) and at stop (atexit, and
 *    SIGTERM when the application has no handler of its own), never from a callback.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cupti_result.h>
#include <cupti_version.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_driver_cbid.h>
#include <cupti_runtime_cbid.h>

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ridgeline_cupti_abi.h"
#include "ridgeline_wire.h"

#define RL_EXPORT __attribute__((visibility("default")))

/* The header's newest record types, for the sizes reported in test mode only: in a
 * served process record sizes always come from the libcupti actually loaded
 * (cuptiActivityGetStructSize, or CUPTI's own cuptiActivityGetNextRecord walk). */
#if CUPTI_API_VERSION >= 130401          /* CUDA 13.4+ */
#define RL_HDR_KERNEL_T CUpti_ActivityKernel13
#define RL_HDR_MEMCPY_T CUpti_ActivityMemcpy7
#define RL_HDR_MEMSET_T CUpti_ActivityMemset5
#elif CUPTI_API_VERSION >= 130301        /* 13.3 */
#define RL_HDR_KERNEL_T CUpti_ActivityKernel12
#elif CUPTI_API_VERSION >= 130101        /* 13.1, 13.2 */
#define RL_HDR_KERNEL_T CUpti_ActivityKernel11
#elif CUPTI_API_VERSION >= 130001        /* 13.0 */
#define RL_HDR_KERNEL_T CUpti_ActivityKernel10
#else                                    /* 12.x */
#define RL_HDR_KERNEL_T CUpti_ActivityKernel9
#endif
#ifndef RL_HDR_MEMCPY_T
#if CUPTI_API_VERSION >= 26              /* 12.8 .. 13.3 */
#define RL_HDR_MEMCPY_T CUpti_ActivityMemcpy6
#else
#define RL_HDR_MEMCPY_T CUpti_ActivityMemcpy5
#endif
#define RL_HDR_MEMSET_T CUpti_ActivityMemset4
#endif
#if CUPTI_API_VERSION >= 130001
#define RL_HDR_MARKER_DATA_T CUpti_ActivityMarkerData2
#else
#define RL_HDR_MARKER_DATA_T CUpti_ActivityMarkerData
#endif

/* The fixed offsets of ridgeline_cupti_abi.h hold for the header we are built with. */
_Static_assert(offsetof(RL_HDR_KERNEL_T, name) == RL_KERNEL_OFF_NAME, "kernel name offset");
_Static_assert(offsetof(RL_HDR_KERNEL_T, deviceId) == RL_KERNEL_OFF_DEVICE_ID, "kernel deviceId offset");
_Static_assert(offsetof(RL_HDR_MEMCPY_T, deviceId) == RL_MEMCPY_OFF_DEVICE_ID, "memcpy deviceId offset");
_Static_assert(offsetof(RL_HDR_MEMSET_T, deviceId) == RL_MEMSET_OFF_DEVICE_ID, "memset deviceId offset");
_Static_assert(offsetof(CUpti_ActivityMarker2, name) == RL_MARKER_OFF_NAME, "marker name offset");
_Static_assert(offsetof(CUpti_ActivityMarker2, domain) == RL_MARKER_OFF_DOMAIN, "marker domain offset");
_Static_assert(sizeof(CUpti_ActivityMarker2) == RL_MARKER_MIN_SIZE, "Marker2 size");
#if CUPTI_API_VERSION >= 130202
_Static_assert(sizeof(rl_subscriber_params_t) == sizeof(CUpti_SubscriberParams) &&
                   offsetof(rl_subscriber_params_t, allowMultipleSubscribers) ==
                       offsetof(CUpti_SubscriberParams, allowMultipleSubscribers) &&
                   offsetof(rl_subscriber_params_t, oldSubscriberSize) == offsetof(CUpti_SubscriberParams, oldSubscriberSize),
               "CUpti_SubscriberParams layout");
_Static_assert(RL_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE == CUPTI_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE, "attr");
#endif
/* The largest BATCH body: header, every name at once (after a reconnect), one buffer's
 * records in sections. It must fit what the agent accepts. */
_Static_assert((uint64_t)sizeof(rl_batch_t) + (uint64_t)RL_MAX_NAMES * (sizeof(rl_name_t) + 7) + RL_MAX_NAME_BYTES_TOTAL +
                       RL_MAX_BUFFER_BYTES + 64 * sizeof(rl_section_t) <= RL_MAX_BODY_BYTES,
               "largest batch exceeds the agent's limit");
_Static_assert(sizeof(rl_frame_t) == 16 && sizeof(rl_batch_t) == 168 && sizeof(rl_hello_t) == 40, "wire");

#define RL_KIND_MAX 64
/* Memory the library may hold in the served process: the record pool (pool slots x buffer
 * size) and the buffers handed to CUPTI (outstanding buffers x buffer size). */
#define RL_MAX_POOL_BYTES ((size_t)1 << 30)
#define RL_MAX_CUPTI_BYTES ((size_t)2 << 30)
#define RL_NAME_MAX_LEN 4096          /* = MAX_NAME_BYTES of probes/cupti/protocol.py */
#define RL_NAME_HASH_MAX (1u << 20)   /* bytes of a long name hashed, bounding the time spent */
#define RL_STATUS_MAX 2048

/* ------------------------------------------------------------------------------------ */
/* libcupti entry points, resolved with dlsym                                            */

typedef CUptiResult (*fn_GetVersion)(uint32_t *);
typedef CUptiResult (*fn_RegisterCallbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
typedef CUptiResult (*fn_Kind)(CUpti_ActivityKind);
typedef CUptiResult (*fn_GetNextRecord)(uint8_t *, size_t, CUpti_Activity **);
typedef CUptiResult (*fn_GetNumDropped)(CUcontext, uint32_t, size_t *);
typedef CUptiResult (*fn_FlushAll)(uint32_t);
typedef CUptiResult (*fn_FlushPeriod)(uint32_t);
typedef CUptiResult (*fn_EnableApi)(CUpti_CallbackId, uint8_t);
typedef CUptiResult (*fn_Enable8)(uint8_t);
typedef CUptiResult (*fn_Subscribe)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *);
typedef CUptiResult (*fn_Subscribe2)(CUpti_SubscriberHandle *, CUpti_CallbackFunc, void *, rl_subscriber_params_t *);
typedef CUptiResult (*fn_Unsubscribe)(CUpti_SubscriberHandle);
typedef CUptiResult (*fn_StructSize)(CUpti_ActivityKind, uint32_t, size_t *);
typedef CUptiResult (*fn_GetResultString)(CUptiResult, const char **);
typedef CUptiResult (*fn_RegisterCallbacks2)(CUpti_SubscriberHandle, rl_buffer_request2_fn, rl_buffer_complete2_fn);
typedef CUptiResult (*fn_Kind2)(CUpti_SubscriberHandle, CUpti_ActivityKind, void *config);
typedef CUptiResult (*fn_GetNumDropped2)(CUpti_SubscriberHandle, CUcontext, uint32_t, size_t *);
typedef CUptiResult (*fn_GetTimestamp)(uint64_t *);
typedef CUptiResult (*fn_GetEnabledKinds)(CUpti_SubscriberHandle, CUpti_ActivityKind *, uint32_t *, uint32_t *);
typedef CUptiResult (*fn_EnableApi2)(CUpti_SubscriberHandle, CUpti_CallbackId, uint8_t);
typedef int (*fn_NvtxInit)(void *);
typedef CUptiResult (*fn_GetAttribute2)(CUpti_SubscriberHandle, CUpti_ActivityAttribute, size_t *, void *);
typedef CUptiResult (*fn_SetAttribute)(CUpti_ActivityAttribute, size_t *, void *);

static struct {
    void *lib;
    fn_GetVersion GetVersion;
    fn_RegisterCallbacks RegisterCallbacks;
    fn_Kind Enable, Disable;
    fn_GetNextRecord GetNextRecord;
    fn_GetNumDropped GetNumDropped;
    fn_FlushAll FlushAll;
    fn_FlushPeriod FlushPeriod;
    fn_EnableApi EnableRuntimeApi, EnableDriverApi;
    fn_Enable8 EnableLatencyTimestamps;
    fn_Subscribe Subscribe;
    fn_Subscribe2 Subscribe2;
    fn_Unsubscribe Unsubscribe;
    fn_StructSize StructSize;
    fn_GetResultString GetResultString;
    fn_RegisterCallbacks2 RegisterCallbacks2;
    fn_Kind2 Enable2, Disable2;
    fn_EnableApi2 EnableRuntimeApi2, EnableDriverApi2;
    fn_GetAttribute2 GetAttribute2;
    fn_SetAttribute SetAttribute;
    fn_GetNumDropped2 GetNumDropped2;
    fn_GetEnabledKinds GetEnabledKinds;
    fn_GetTimestamp GetTimestamp;
} C;

/* ------------------------------------------------------------------------------------ */
/* configuration (environment, read once)                                               */

static struct {
    char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    size_t buffer_bytes;        /* size of each buffer handed to CUPTI and of each pool slot */
    unsigned pool_slots;
    unsigned max_cupti_buffers; /* CUPTI buffers outstanding at once; beyond: CUPTI drops */
    unsigned flush_ms;
    unsigned reconnect_ms;
    unsigned stall_ms;          /* abandon a connection that accepts nothing for this long */
    int graph_level;
    int initial_mode;
    unsigned kernel_sample_every;
    int quiet;
    unsigned device_buffer_pool_limit; /* CUPTI_ACTIVITY_ATTR_DEVICE_BUFFER_POOL_LIMIT (0 = CUPTI's default) */
    int exit_flush;
    int sigterm_flush;      /* flush on SIGTERM when the application has no handler of its own */
    unsigned stop_flush_ms; /* how long a stop (SIGTERM) may wait for the records to ship */
} cfg;

/* ------------------------------------------------------------------------------------ */
/* state                                                                                 */

enum { SLOT_FREE = 0, SLOT_FILLING = 1, SLOT_READY = 2 };

typedef struct {
    uint8_t *data;       /* rl_section_t headers + records */
    size_t used;
    uint64_t records;
    uint64_t seq;
    uint32_t n_sections;
    uint32_t n_devices;
    uint32_t devices[RL_MAX_DEVICES];
    int state;
} slot_t;

typedef struct {
    uintptr_t ptr;
    uint32_t off;
    uint32_t len;
} name_ent_t;

static pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_pool_cond = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_names_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t g_status_lock = PTHREAD_MUTEX_INITIALIZER;

static slot_t *g_slots;
static size_t g_slot_cap;
static uint64_t g_seq;

static name_ent_t *g_names;      /* open addressing on ptr */
static uint32_t g_names_cap;     /* power of two */
static uint32_t g_names_count;
static uint32_t *g_name_order;   /* entry indices in insertion order */
static uint32_t g_names_max;
static char *g_strings;
static size_t g_strings_used, g_strings_cap, g_strings_max;

static uint32_t g_rec_size[RL_KIND_MAX]; /* 0 = unknown kind */
static int g_walk_with_cupti;

static atomic_int g_initialized;
static atomic_int g_active;           /* collection set up, sender may run */
static atomic_int g_sender_running;
static atomic_int g_stop;
static atomic_int g_mode;
static atomic_uint g_sample_every;
static atomic_uint g_flags;
static uint32_t g_cupti_version;
static pthread_t g_sender;
static CUpti_SubscriberHandle g_sub;
static int g_multi;
static int g_test_mode;
static int g_pid;
static atomic_int g_outstanding_buffers;
static atomic_uint_fast64_t g_kernel_counter;
static atomic_int g_warned_kernel_layout;

static struct {
    atomic_uint_fast64_t dropped_cupti, dropped_pool_full, dropped_no_agent, dropped_send, sampled_out,
        names_dropped, walk_errors, records_in, records_sent, batches_sent, connects, buffers_refused,
        buffers_lost, flushes, takeovers, reclaims, connects_busy;
} K;

static char g_status[RL_STATUS_MAX];
static atomic_uint g_status_gen;      /* bumped with every status line or flag change */
static atomic_int g_taken_over;       /* legacy CUPTI: another client holds our callbacks */
static atomic_int g_reclaim_req;      /* the agent asked to reclaim after a takeover */
static atomic_int g_send_pending;     /* the sender holds a message not fully sent */
static atomic_int g_exiting;          /* our atexit handler ran: no sender (re)start */
static int g_wake_pipe[2] = {-1, -1}; /* SIGTERM handler -> sender: flush and ship now */
static int g_ack_pipe[2] = {-1, -1};  /* sender -> SIGTERM handler: done */

/* ------------------------------------------------------------------------------------ */
/* logging and status                                                                    */

static void rl_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void rl_log(const char *fmt, ...) {
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

static const char *cupti_err(CUptiResult r) {
    const char *s = NULL;
    if (C.GetResultString && C.GetResultString(r, &s) == CUPTI_SUCCESS && s) return s;
    return "unknown CUPTI error";
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static long env_long(const char *name, long dflt, long lo, long hi) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) return dflt;
    return x;
}

/* A unix socket path must fit sun_path (107 bytes and the NUL). A longer one is refused
 * with a logged reason: cutting it would connect to some other path. */
static void set_socket_path(const char *p) {
    if (strlen(p) >= sizeof cfg.socket_path) {
        cfg.socket_path[0] = 0;
        rl_log("socket path %.60s... is %zu bytes, over the %zu-byte limit of a unix socket path: "
               "records will not be sent (set RIDGELINE_SOCKET to a shorter path)",
               p, strlen(p), sizeof cfg.socket_path - 1);
        return;
    }
    snprintf(cfg.socket_path, sizeof cfg.socket_path, "%s", p);
}

static void read_config(void) {
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

/* ------------------------------------------------------------------------------------ */
/* interned names (kernel names, NVTX names and domains: CUPTI-owned memory)             */

static int names_alloc(void) {
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
static void intern_ptr(uintptr_t ptr) {
    if (!ptr) return;
    uint32_t mask = g_names_cap - 1;
    uint32_t h = (uint32_t)((ptr >> 3) * 0x9E3779B97F4A7C15ull >> 32) & mask;
    while (g_names[h].ptr) {
        if (g_names[h].ptr == ptr) return;
        h = (h + 1) & mask;
    }
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

/* ------------------------------------------------------------------------------------ */
/* record sizes and the buffer walk                                                      */

static void sizes_from_header(void) {
    memset(g_rec_size, 0, sizeof g_rec_size);
    g_rec_size[CUPTI_ACTIVITY_KIND_KERNEL] = sizeof(RL_HDR_KERNEL_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL] = sizeof(RL_HDR_KERNEL_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_MEMCPY] = sizeof(RL_HDR_MEMCPY_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_MEMSET] = sizeof(RL_HDR_MEMSET_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_RUNTIME] = sizeof(CUpti_ActivityAPI);
    g_rec_size[CUPTI_ACTIVITY_KIND_DRIVER] = sizeof(CUpti_ActivityAPI);
    g_rec_size[CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API] = sizeof(CUpti_ActivityAPI);
    g_rec_size[CUPTI_ACTIVITY_KIND_MARKER] = sizeof(CUpti_ActivityMarker2);
    g_rec_size[CUPTI_ACTIVITY_KIND_MARKER_DATA] = sizeof(RL_HDR_MARKER_DATA_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION] = sizeof(CUpti_ActivityExternalCorrelation);
    g_rec_size[CUPTI_ACTIVITY_KIND_GRAPH_TRACE] = sizeof(CUpti_ActivityGraphTrace2);
}

/* Sizes for the libcupti actually loaded, never the compiled-in header's: CUPTI >= 13.2
 * tells us (cuptiActivityGetStructSize); an older one (a libcupti.so.12 torch loaded,
 * 13.0, 13.1) is walked with its own cuptiActivityGetNextRecord. */
static void sizes_for_runtime(uint32_t version) {
    (void)version;
    if (C.StructSize) {
        memset(g_rec_size, 0, sizeof g_rec_size);
        int ok = 1;
        static const CUpti_ActivityKind kinds[] = {
            /* needed: */
            CUPTI_ACTIVITY_KIND_KERNEL, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
            CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER,
            CUPTI_ACTIVITY_KIND_MARKER, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
            /* optional: */
            CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API, CUPTI_ACTIVITY_KIND_MARKER_DATA, CUPTI_ACTIVITY_KIND_GRAPH_TRACE};
        /* the kinds always enabled must be sized; the others (deep mode, graph level) may be
         * unknown to this release: their records then end a walk, counted */
        for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
            size_t s = 0;
            int needed = i < 8;
            if (C.StructSize(kinds[i], 0, &s) != CUPTI_SUCCESS || s == 0 || s % 8 || s > RL_MAX_RECORD_BYTES) {
                if (needed) ok = 0;
            } else {
                g_rec_size[kinds[i]] = (uint32_t)s;
            }
        }
        if (ok) return;
        memset(g_rec_size, 0, sizeof g_rec_size);
    }
    g_walk_with_cupti = 1;
    atomic_fetch_or(&g_flags, RL_FLAG_WALK_WITH_CUPTI);
}

/* Size of the record at p, or 0 when the walk must stop. */
static size_t record_size(uint8_t *buf, size_t valid, uint8_t *p) {
    size_t left = valid - (size_t)(p - buf);
    if (left < 8) return 0;
    int32_t kind;
    memcpy(&kind, p, 4);
    if (g_walk_with_cupti && C.GetNextRecord) {
        CUpti_Activity *rec = (CUpti_Activity *)p;
        /* GetNextRecord advances from the record it was given; sizes it reveals are
         * remembered so the last record of a buffer (no successor) gets its own size. */
        CUptiResult r = C.GetNextRecord(buf, valid, &rec);
        if (r == CUPTI_SUCCESS) {
            size_t sz = (size_t)((uint8_t *)rec - p);
            if ((uint8_t *)rec <= p || sz % 8 || sz > RL_MAX_RECORD_BYTES || sz > left) return 0;
            if (kind > 0 && kind < RL_KIND_MAX) g_rec_size[kind] = (uint32_t)sz;
            return sz;
        }
        /* No successor. For the last record (MAX_LIMIT_REACHED) the size is what is left
         * of the valid bytes, provided that agrees with what this kind measured before
         * (or is plausible for a kind not seen yet). Any other error is about the next
         * record (CUPTI checks it): this one still has the size its kind measured, and the
         * walk stops at the next. Never make the rest of the buffer one oversized record. */
        if (kind <= 0 || kind >= RL_KIND_MAX) return 0;
        if (r != CUPTI_ERROR_MAX_LIMIT_REACHED) return g_rec_size[kind] && g_rec_size[kind] < left ? g_rec_size[kind] : 0;
        if (g_rec_size[kind]) return g_rec_size[kind] == left ? left : 0;
        return (left % 8 == 0 && left <= RL_MAX_RECORD_BYTES) ? left : 0;
    }
    if (kind <= 0 || kind >= RL_KIND_MAX || g_rec_size[kind] == 0 || g_rec_size[kind] > left) return 0;
    return g_rec_size[kind];
}

static const uint32_t RL_KERNEL_SIZES[] = RL_KERNEL_KNOWN_SIZES;

static int kernel_layout_known(size_t sz) {
    for (size_t i = 0; i < sizeof RL_KERNEL_SIZES / sizeof RL_KERNEL_SIZES[0]; i++)
        if (RL_KERNEL_SIZES[i] == sz) return 1;
    return 0;
}

static void note_device(slot_t *s, uint32_t dev) {
    for (uint32_t i = 0; i < s->n_devices; i++)
        if (s->devices[i] == dev) return;
    if (s->n_devices < RL_MAX_DEVICES) s->devices[s->n_devices++] = dev;
}

static uint64_t count_records(uint8_t *buf, size_t valid) {
    uint64_t n = 0;
    uint8_t *p = buf;
    size_t sz;
    while ((size_t)(p - buf) < valid && (sz = record_size(buf, valid, p)) != 0) {
        n++;
        p += sz;
    }
    return n;
}

static void start_sender_if_needed(void);

/* ridgeline_cupti_guest.c: timestamps of another client's source, and sharing CUPTI with it */
#include "ridgeline_cupti_guest.h"
static void clock_snapshot(rl_clock_map_t *out);
static int clock_fix(uint8_t *rec, int kind, size_t sz, const rl_clock_map_t *m);
static int record_ours(const uint8_t *p, int kind, size_t sz);
static void guest_tee(uint8_t *buf, size_t valid);
static int guest_own_buffer(uint8_t *buf, size_t size, size_t valid);
static void guest_adopt(void);
static void clock_tick(void);
static atomic_int g_cupti_finalized;
static atomic_uchar g_our_kind[RL_KIND_MAX];

/* The completed-buffer path: copy records into a pool slot grouped by kind, intern the
 * new name pointers, hand the slot to the sender, return. Never blocks on I/O. */
static void process_buffer(uint8_t *buf, size_t valid) {
    if (!buf || valid == 0 || !g_slots) return;
    if (getpid() != g_pid) {
        /* forked child: our sender thread did not survive the fork */
        g_pid = getpid();
        atomic_store(&g_sender_running, 0);
    }
    start_sender_if_needed();

    slot_t *slot = NULL;
    pthread_mutex_lock(&g_pool_lock);
    for (unsigned i = 0; i < cfg.pool_slots; i++)
        if (g_slots[i].state == SLOT_FREE) {
            slot = &g_slots[i];
            slot->state = SLOT_FILLING;
            break;
        }
    pthread_mutex_unlock(&g_pool_lock);
    if (!slot) {
        atomic_fetch_add(&K.dropped_pool_full, count_records(buf, valid));
        return;
    }

    /* pass 1: count per kind */
    uint32_t counts[RL_KIND_MAX] = {0};
    uint32_t sizes[RL_KIND_MAX] = {0};
    uint8_t *p = buf, *end = buf + valid;
    size_t sz = 0;
    int cut = 0;
    while (p < end) {
        sz = record_size(buf, valid, p);
        if (!sz) {
            cut = 1;
            break;
        }
        int32_t kind;
        memcpy(&kind, p, 4);
        if (kind <= 0 || kind >= RL_KIND_MAX || (sizes[kind] && sizes[kind] != sz)) {
            cut = 1;
            break;
        }
        sizes[kind] = (uint32_t)sz;
        counts[kind]++;
        p += sz;
    }
    if (cut) atomic_fetch_add(&K.walk_errors, 1);
    uint8_t *walk_end = p;

    /* lay out sections */
    size_t offs[RL_KIND_MAX];
    size_t used = 0;
    uint32_t nsec = 0;
    /* Deep mode is for seeing everything: sampling applies to always-on only. */
    unsigned every = atomic_load(&g_mode) == RL_MODE_DEEP ? 1 : atomic_load(&g_sample_every);
    if (!every) every = 1;
    for (int k = 1; k < RL_KIND_MAX; k++) {
        if (!counts[k]) continue;
        offs[k] = used + sizeof(rl_section_t);
        used = offs[k] + (size_t)counts[k] * sizes[k];
        nsec++;
    }
    if (used > g_slot_cap) { /* cannot happen: sections add 16 B per kind to a buffer <= slot */
        pthread_mutex_lock(&g_pool_lock);
        slot->state = SLOT_FREE;
        pthread_mutex_unlock(&g_pool_lock);
        atomic_fetch_add(&K.dropped_pool_full, count_records(buf, valid));
        return;
    }

    /* pass 2: copy, intern names, sample kernels in always-on mode */
    uint32_t kept[RL_KIND_MAX] = {0};
    uint64_t sampled = 0;
    uint32_t unknown_kernel_size = 0;
    slot->n_devices = 0;
    rl_clock_map_t clk;
    clock_snapshot(&clk);
    pthread_mutex_lock(&g_names_lock);
    for (p = buf; p < walk_end; p += sz) {
        int32_t kind;
        memcpy(&kind, p, 4);
        sz = sizes[kind];
        if (!record_ours(p, kind, sz)) continue; /* another client's kind, in a shared CUPTI */
        if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            if (every > 1 && (atomic_fetch_add(&g_kernel_counter, 1) % every) != 0) {
                sampled++;
                continue;
            }
            /* Only a layout we know has its name pointer at RL_KERNEL_OFF_NAME; in any other
             * record that offset may hold anything, and dereferencing it could crash the
             * served process. Such records still go to the agent, nameless. */
            if (kernel_layout_known(sz)) {
                uintptr_t nm;
                memcpy(&nm, p + RL_KERNEL_OFF_NAME, sizeof nm);
                intern_ptr(nm);
                uint32_t dev;
                memcpy(&dev, p + RL_KERNEL_OFF_DEVICE_ID, 4);
                note_device(slot, dev);
            } else {
                unknown_kernel_size = (uint32_t)sz;
            }
        } else if (kind == CUPTI_ACTIVITY_KIND_MARKER && sz >= RL_MARKER_MIN_SIZE) {
            uintptr_t nm, dom;
            memcpy(&nm, p + RL_MARKER_OFF_NAME, sizeof nm);
            memcpy(&dom, p + RL_MARKER_OFF_DOMAIN, sizeof dom);
            intern_ptr(nm);
            intern_ptr(dom);
        } else if ((kind == CUPTI_ACTIVITY_KIND_MEMCPY || kind == CUPTI_ACTIVITY_KIND_MEMSET) &&
                   sz >= RL_MEMCPY_OFF_DEVICE_ID + 4) {
            uint32_t dev;
            memcpy(&dev, p + (kind == CUPTI_ACTIVITY_KIND_MEMCPY ? RL_MEMCPY_OFF_DEVICE_ID : RL_MEMSET_OFF_DEVICE_ID), 4);
            note_device(slot, dev);
        }
        memcpy(slot->data + offs[kind] + (size_t)kept[kind] * sz, p, sz);
        (void)clock_fix(slot->data + offs[kind] + (size_t)kept[kind] * sz, kind, sz, &clk);
        kept[kind]++;
    }
    pthread_mutex_unlock(&g_names_lock);
    if (unknown_kernel_size && !atomic_exchange(&g_warned_kernel_layout, 1))
        rl_log("kernel records of %u bytes: layout not known to this library; sent without names", unknown_kernel_size);

    /* section headers (sampling may have left a kernel section shorter: compact) */
    size_t w = 0;
    uint64_t total = 0;
    nsec = 0;
    for (int k = 1; k < RL_KIND_MAX; k++) {
        if (!counts[k] || !kept[k]) continue;
        rl_section_t h = {(uint32_t)k, sizes[k], kept[k], 0};
        size_t bytes = (size_t)kept[k] * sizes[k];
        memmove(slot->data + w + sizeof h, slot->data + offs[k], bytes);
        memcpy(slot->data + w, &h, sizeof h);
        w += sizeof h + bytes;
        total += kept[k];
        nsec++;
    }
    if (sampled) atomic_fetch_add(&K.sampled_out, sampled);
    atomic_fetch_add(&K.records_in, total);
    slot->used = w;
    slot->records = total;
    slot->n_sections = nsec;

    pthread_mutex_lock(&g_pool_lock);
    slot->seq = ++g_seq;
    slot->state = nsec ? SLOT_READY : SLOT_FREE;
    pthread_cond_signal(&g_pool_cond);
    pthread_mutex_unlock(&g_pool_lock);
}

/* ------------------------------------------------------------------------------------ */
/* buffers handed to CUPTI, watched for a takeover                                       */
/*
 * On a legacy (single-subscriber) CUPTI the buffer callbacks are process-global: a later
 * cuptiActivityRegisterCallbacks by torch.profiler (Kineto) replaces ours, and CUPTI then
 * completes even the buffers we handed out to Kineto's callback, which drops ("unknown
 * buffer") and leaks them. Nothing tells us. What we can see, from our sender thread
 * right after our own cuptiActivityFlushAll(0): a buffer of ours into which CUPTI has
 * written records (its first record's kind is no longer the 0 we put there), which a
 * default flush should have returned, still not back after RL_TAKEOVER_TICKS flushes and
 * RL_TAKEOVER_MIN_MS. The peek never touches memory that may have been freed: it goes
 * through write(2) on a private pipe, which fails with EFAULT instead of faulting (an
 * unmapped buffer is itself proof that someone else completed and freed it).
 */
#define RL_TAKEOVER_TICKS 3
#define RL_TAKEOVER_MIN_MS 1000

typedef struct {
    uint8_t *buf;
    uint64_t written_since_ms; /* first tick at which CUPTI had written into it; 0 = not yet */
    uint32_t ticks;            /* consecutive flushes it was written and not returned */
    int lost;                  /* counted as taken by another client */
    uint64_t seq;              /* order handed out: the newest is CUPTI's current buffer */
} cbuf_t;

static int make_pipe(int p[2]) { return pipe2(p, O_CLOEXEC | O_NONBLOCK); }

static pthread_mutex_t g_cbuf_lock = PTHREAD_MUTEX_INITIALIZER;
static cbuf_t *g_cbufs;
static unsigned g_cbufs_cap;
static int g_peek_pipe[2] = {-1, -1};
static uint64_t g_cbuf_seq;

static void cbuf_add(uint8_t *b) {
    pthread_mutex_lock(&g_cbuf_lock);
    cbuf_t *freeslot = NULL, *oldest_lost = NULL;
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++) {
        if (!g_cbufs[i].buf) { freeslot = &g_cbufs[i]; break; }
        if (g_cbufs[i].lost && !oldest_lost) oldest_lost = &g_cbufs[i];
    }
    if (!freeslot) freeslot = oldest_lost; /* forget the oldest lost one */
    if (freeslot) *freeslot = (cbuf_t){b, 0, 0, 0, ++g_cbuf_seq};
    pthread_mutex_unlock(&g_cbuf_lock);
}

/* Returns -1 if b was counted lost (its outstanding count already released), 1 if it is
 * not a buffer we handed out (see buffer_done), else 0. */
static int cbuf_remove(uint8_t *b) {
    int lost = 0, found = !g_cbufs; /* without the table (out of memory) every buffer is ours */
    pthread_mutex_lock(&g_cbuf_lock);
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++)
        if (g_cbufs[i].buf == b) {
            lost = g_cbufs[i].lost;
            found = 1;
            g_cbufs[i].buf = NULL;
            break;
        }
    pthread_mutex_unlock(&g_cbuf_lock);
    return !found ? 1 : lost ? -1 : 0;
}

static int cbuf_known(uint8_t *b) {
    int found = !g_cbufs;
    pthread_mutex_lock(&g_cbuf_lock);
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap && !found; i++) found = g_cbufs[i].buf == b;
    pthread_mutex_unlock(&g_cbuf_lock);
    return found;
}

/* The kind of the first record in b, 0 if none yet, -1 if b is no longer mapped. */
static int peek_kind(const uint8_t *b) {
    int32_t kind = 0;
    if (g_peek_pipe[1] < 0) return 0;
    if (write(g_peek_pipe[1], b, sizeof kind) != (ssize_t)sizeof kind) return errno == EFAULT ? -1 : 0;
    if (read(g_peek_pipe[0], &kind, sizeof kind) != (ssize_t)sizeof kind) return 0;
    return kind;
}

static void takeover_detected(unsigned lost, const char *why);
static void takeover_false_alarm(void);

/* Sender thread, right after cuptiActivityFlushAll(0) returned. */
static void watch_takeover(uint64_t now) {
    unsigned lost = 0;
    int unmapped = 0;
    pthread_mutex_lock(&g_cbuf_lock);
    /* The newest buffer handed out is the one CUPTI is filling. A default flush does not
     * return a buffer holding an incomplete record (cupti_activity.h, cuptiActivityFlushAll:
     * "It doesn't return buffers which have one or more incomplete records"), and while
     * the GPU is busy that buffer always holds a kernel in flight: below a buffer's worth of
     * records a second it stays out for seconds with nothing wrong. Only a buffer CUPTI
     * has moved on from (it asked us for a newer one) can be overdue; the current one is
     * judged by an unmapped peek only. (A takeover that keeps the current buffer is
     * announced by Kineto's timestamp source, clock_tick, or seen exactly when preloaded.) */
    uint64_t newest = 0;
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++)
        if (g_cbufs[i].buf && !g_cbufs[i].lost && g_cbufs[i].seq > newest) newest = g_cbufs[i].seq;
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++) {
        cbuf_t *e = &g_cbufs[i];
        if (!e->buf || e->lost) continue;
        int k = peek_kind(e->buf);
        if (k < 0) unmapped = 1;
        if (k > 0 && e->seq == newest) {
            e->ticks = 0;
            e->written_since_ms = 0;
            continue;
        }
        if (k == 0) {
            e->ticks = 0;
            e->written_since_ms = 0;
            continue;
        }
        if (!e->written_since_ms) e->written_since_ms = now;
        if (k < 0 || (++e->ticks >= RL_TAKEOVER_TICKS && now - e->written_since_ms >= RL_TAKEOVER_MIN_MS)) {
            e->lost = 1;
            lost++;
        }
    }
    pthread_mutex_unlock(&g_cbuf_lock);
    if (lost) {
        atomic_fetch_sub(&g_outstanding_buffers, (int)lost);
        takeover_detected(lost, unmapped ? "a buffer of ours was freed by someone else"
                                         : "buffers CUPTI filled for us were not returned by our flushes");
    }
}

/* Sender thread: a takeover shown another way (the other client's timestamp source): every
 * buffer of ours still inside CUPTI will be completed to that client. */
static unsigned cbufs_all_lost(void) {
    unsigned lost = 0;
    pthread_mutex_lock(&g_cbuf_lock);
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++)
        if (g_cbufs[i].buf && !g_cbufs[i].lost) {
            g_cbufs[i].lost = 1;
            lost++;
        }
    pthread_mutex_unlock(&g_cbuf_lock);
    if (lost) atomic_fetch_sub(&g_outstanding_buffers, (int)lost);
    return lost;
}

/* ------------------------------------------------------------------------------------ */
/* sink buffers: refusing a buffer (NULL) can crash CUPTI before API version 27 (CUDA 12.9;
 * 12.4 reports 22, 12.8 26). There a refused request gets a sink instead: CUPTI writes into
 * it, and its records are dropped on completion and counted as dropped_cupti, which is
 * what CUPTI itself counts when it has no buffer. Sinks are small and bounded; past
 * RL_MAX_SINKS all further ones share one static sink, never read and never freed.      */

#define RL_CUPTI_NULL_BUFFER_SAFE 27
#define RL_SINK_BYTES ((size_t)256 << 10)
#define RL_MAX_SINKS 64
static pthread_mutex_t g_sink_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *g_sinks[RL_MAX_SINKS];
static _Alignas(8) uint8_t g_static_sink[RL_SINK_BYTES];
static atomic_uint_fast64_t g_sinks_handed;   /* sinks handed out (for the tests) */

/* 1 when this libcupti may crash on a NULL buffer (0 = not reported: be safe). */
static int null_buffer_unsafe(void) { return g_cupti_version < RL_CUPTI_NULL_BUFFER_SAFE; }

static uint8_t *sink_get(void) {
    uint8_t *b = malloc(RL_SINK_BYTES);
    pthread_mutex_lock(&g_sink_lock);
    int placed = 0;
    for (unsigned i = 0; b && i < RL_MAX_SINKS; i++)
        if (!g_sinks[i]) {
            g_sinks[i] = b;
            placed = 1;
            break;
        }
    pthread_mutex_unlock(&g_sink_lock);
    if (!placed) {
        free(b);
        b = g_static_sink;
    }
    memset(b, 0, 8);
    atomic_fetch_add(&g_sinks_handed, 1);
    return b;
}

/* If b is a sink: count its records as dropped, free it, return 1. */
static uint64_t count_records(uint8_t *buf, size_t valid);
static int sink_release(uint8_t *b, size_t valid) {
    int found = b == g_static_sink;
    if (!found) {
        pthread_mutex_lock(&g_sink_lock);
        for (unsigned i = 0; i < RL_MAX_SINKS; i++)
            if (g_sinks[i] == b) {
                g_sinks[i] = NULL;
                found = 1;
                break;
            }
        pthread_mutex_unlock(&g_sink_lock);
        if (!found) return 0;
        if (valid) atomic_fetch_add(&K.dropped_cupti, count_records(b, valid));
        free(b);
        return 1;
    }
    /* the static sink may be written by several CUPTI buffers at once: its content is
     * not trusted; each completion counts as at least one record lost */
    atomic_fetch_add(&K.dropped_cupti, valid ? 1 : 0);
    return 1;
}

/* ------------------------------------------------------------------------------------ */
/* CUPTI buffer callbacks                                                                */

static void refuse_buffer(uint8_t **buffer, size_t *size) {
    atomic_fetch_add(&K.buffers_refused, 1);
    if (!null_buffer_unsafe()) return;
    *buffer = sink_get();
    *size = RL_SINK_BYTES;
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *max_records = 0;
    *size = 0;
    *buffer = NULL;
    /* Bounded: past the cap CUPTI drops records and counts them (reported as dropped_cupti);
     * before CUPTI API version 27 CUPTI gets a sink instead of NULL (see sink_get). */
    if (atomic_fetch_add(&g_outstanding_buffers, 1) >= (int)cfg.max_cupti_buffers) {
        atomic_fetch_sub(&g_outstanding_buffers, 1);
        refuse_buffer(buffer, size);
        return;
    }
    void *b = NULL;
    if (posix_memalign(&b, 8, cfg.buffer_bytes) != 0) {
        atomic_fetch_sub(&g_outstanding_buffers, 1);
        refuse_buffer(buffer, size);
        return;
    }
    memset(b, 0, 8); /* kind 0 until CUPTI writes a record: what watch_takeover looks at */
    cbuf_add(b);
    *buffer = b;
    *size = cfg.buffer_bytes;
}

/* Frees a buffer CUPTI gave back. Any buffer reaching our callback while a takeover is
 * flagged (in particular one we had counted as lost) means there was none: a long-running
 * record held that buffer back. */
static void buffer_done(uint8_t *buffer) {
    if (!buffer) return;
    int r = cbuf_remove(buffer);
    if (r > 0) {
        /* Another client's buffer: after a reclaim while that tool (Kineto) still had
         * buffers inside CUPTI, CUPTI completes them to us. Its owner frees it (Kineto's
         * CuptiActivityBuffer is a std::vector): freeing it here would be a double free in
         * the served process. Its records were read; the buffer is left alone. (A buffer
         * of ours whose entry was forgotten after a takeover leaks here instead.) */
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            rl_log("reclaim: a buffer of another CUPTI client reached Ridgeline (it was still collecting); "
                   "left to its owner");
        return;
    }
    int was_lost = r < 0;
    free(buffer);
    if (!was_lost) atomic_fetch_sub(&g_outstanding_buffers, 1);
    /* CUPTI still calls *our* completion callback: nobody replaced it */
    if (was_lost || atomic_load(&g_taken_over)) takeover_false_alarm();
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size,
                                      size_t valid) {
    /* counted before the records are queued, so the batch carrying them reports it */
    if (C.GetNumDropped) {
        size_t dropped = 0;
        if (C.GetNumDropped(ctx, stream_id, &dropped) == CUPTI_SUCCESS && dropped)
            atomic_fetch_add(&K.dropped_cupti, dropped);
    }
    if (sink_release(buffer, valid)) return;
    process_buffer(buffer, valid);
    /* shared CUPTI (preloaded): a buffer the other client handed CUPTI before we registered
     * goes back to it whole; ours give it a copy of its kinds */
    if (!cbuf_known(buffer) && guest_own_buffer(buffer, size, valid)) return;
    guest_tee(buffer, valid);
    buffer_done(buffer);
}

static void CUPTIAPI buffer_requested2(uint8_t **buffer, size_t *size, size_t *max_records,
                                       void *info) {
    (void)info;
    buffer_requested(buffer, size, max_records);
}

static void CUPTIAPI buffer_completed2(uint8_t *buffer, size_t size, size_t valid,
                                       void *info) {
    (void)info;
    (void)size;
    /* Our subscriber's own dropped count (CUPTI 13.3+; reading resets it). 13.2 has only
     * the process-wide v1 count, read as a fallback. */
    size_t dropped = 0;
    if (C.GetNumDropped2) {
        if (C.GetNumDropped2(g_sub, NULL, 0, &dropped) != CUPTI_SUCCESS) dropped = 0;
    } else if (C.GetNumDropped) {
        if (C.GetNumDropped(NULL, 0, &dropped) != CUPTI_SUCCESS) dropped = 0;
    }
    if (dropped) atomic_fetch_add(&K.dropped_cupti, dropped);
    if (sink_release(buffer, valid)) return;
    process_buffer(buffer, valid);
    buffer_done(buffer);
}

static void CUPTIAPI subscriber_callback(void *ud, CUpti_CallbackDomain d, CUpti_CallbackId id, const void *data) {
    (void)ud; (void)d; (void)id; (void)data; /* we enable no callbacks; the handle only claims/probes CUPTI */
}

/* ------------------------------------------------------------------------------------ */
/* which API calls are recorded: launch, graph launch and synchronisation only            */

typedef struct {
    uint32_t domain, cbid, category;
    const char *name;
    int deep_only;
} cbid_ent_t;

#define RL_CBID_RT___cudaLaunchKernel_v13000 505
#define RL_CBID_RT___cudaLaunchKernel_ptsz_v13000 506
#if CUPTI_API_VERSION >= 130001
_Static_assert(CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_v13000 == RL_CBID_RT___cudaLaunchKernel_v13000 &&
                   CUPTI_RUNTIME_TRACE_CBID___cudaLaunchKernel_ptsz_v13000 == RL_CBID_RT___cudaLaunchKernel_ptsz_v13000,
               "CUDA 13 launch cbids");
#endif
#define RL_CBID_DR_cuCtxSynchronize_v2 800
#if CUPTI_API_VERSION >= 130001
_Static_assert(CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2 == RL_CBID_DR_cuCtxSynchronize_v2, "CUDA 13 cbid");
#endif
#define RT(n, cat) {RL_DOMAIN_RUNTIME, CUPTI_RUNTIME_TRACE_CBID_##n, cat, #n, 0}
/* Driver launches too: Triton and other JIT kernels are launched with cuLaunchKernel, not
 * through the runtime, and their kernels join to these records. */
#define DR(n, cat) {RL_DOMAIN_DRIVER, CUPTI_DRIVER_TRACE_CBID_##n, cat, #n, 0}
static const cbid_ent_t CBIDS[] = {
    RT(cudaLaunchKernel_v7000, RL_API_LAUNCH),
    RT(cudaLaunchKernel_ptsz_v7000, RL_API_LAUNCH),
    RT(cudaLaunchKernelExC_v11060, RL_API_LAUNCH),
    RT(cudaLaunchKernelExC_ptsz_v11060, RL_API_LAUNCH),
    RT(cudaLaunchCooperativeKernel_v9000, RL_API_LAUNCH),
    RT(cudaLaunchCooperativeKernel_ptsz_v9000, RL_API_LAUNCH),
    /* The CUDA 13 runtime's launch entry. Its cbid (505/506) is absent from 12.x headers
     * but cbids are append-only, so a library built with those headers still asks a 13.x
     * libcupti for it (a 12.x libcupti rejects the unknown cbid harmlessly). */
    {RL_DOMAIN_RUNTIME, RL_CBID_RT___cudaLaunchKernel_v13000, RL_API_LAUNCH, "__cudaLaunchKernel_v13000", 0},
    {RL_DOMAIN_RUNTIME, RL_CBID_RT___cudaLaunchKernel_ptsz_v13000, RL_API_LAUNCH, "__cudaLaunchKernel_ptsz_v13000", 0},
    RT(cudaGraphLaunch_v10000, RL_API_GRAPH_LAUNCH),
    RT(cudaGraphLaunch_ptsz_v10000, RL_API_GRAPH_LAUNCH),
    RT(cudaStreamSynchronize_v3020, RL_API_SYNC),
    RT(cudaStreamSynchronize_ptsz_v7000, RL_API_SYNC),
    RT(cudaDeviceSynchronize_v3020, RL_API_SYNC),
    RT(cudaEventSynchronize_v3020, RL_API_SYNC),
    RT(cudaThreadSynchronize_v3020, RL_API_SYNC),
    DR(cuLaunchKernel, RL_API_LAUNCH),
    DR(cuLaunchKernel_ptsz, RL_API_LAUNCH),
    DR(cuLaunchKernelEx, RL_API_LAUNCH),
    DR(cuLaunchKernelEx_ptsz, RL_API_LAUNCH),
    DR(cuLaunchCooperativeKernel, RL_API_LAUNCH),
    DR(cuLaunchCooperativeKernel_ptsz, RL_API_LAUNCH),
    DR(cuGraphLaunch, RL_API_GRAPH_LAUNCH),
    DR(cuGraphLaunch_ptsz, RL_API_GRAPH_LAUNCH),
    DR(cuStreamSynchronize, RL_API_SYNC),
    DR(cuStreamSynchronize_ptsz, RL_API_SYNC),
    DR(cuCtxSynchronize, RL_API_SYNC),
    DR(cuEventSynchronize, RL_API_SYNC),
    /* CUDA 13's cuCtxSynchronize (cbid 800, absent from 12.x headers; asked for as above) */
    {RL_DOMAIN_DRIVER, RL_CBID_DR_cuCtxSynchronize_v2, RL_API_SYNC, "cuCtxSynchronize_v2", 0},
    /* Copies and memsets: their API records give each copy its launching thread (joined by
     * correlation id, as kernels are). The calls PyTorch (cudaMemcpyAsync, cudaMemsetAsync)
     * and Triton/NCCL (cuMemcpy*Async, cuMemsetD*Async) make; all in the 12.4 headers. */
    RT(cudaMemcpy_v3020, RL_API_MEMCPY),
    RT(cudaMemcpyAsync_v3020, RL_API_MEMCPY),
    RT(cudaMemcpy_ptds_v7000, RL_API_MEMCPY),
    RT(cudaMemcpyAsync_ptsz_v7000, RL_API_MEMCPY),
    RT(cudaMemcpy2DAsync_v3020, RL_API_MEMCPY),
    RT(cudaMemcpyPeerAsync_v4000, RL_API_MEMCPY),
    RT(cudaMemsetAsync_v3020, RL_API_MEMSET),
    RT(cudaMemsetAsync_ptsz_v7000, RL_API_MEMSET),
    RT(cudaMemset_v3020, RL_API_MEMSET),
    DR(cuMemcpy, RL_API_MEMCPY),
    DR(cuMemcpyAsync, RL_API_MEMCPY),
    DR(cuMemcpyHtoD_v2, RL_API_MEMCPY),
    DR(cuMemcpyDtoH_v2, RL_API_MEMCPY),
    DR(cuMemcpyDtoD_v2, RL_API_MEMCPY),
    DR(cuMemcpyHtoDAsync_v2, RL_API_MEMCPY),
    DR(cuMemcpyDtoHAsync_v2, RL_API_MEMCPY),
    DR(cuMemcpyDtoDAsync_v2, RL_API_MEMCPY),
    DR(cuMemcpyPeerAsync, RL_API_MEMCPY),
    DR(cuMemsetD8Async, RL_API_MEMSET),
    DR(cuMemsetD32Async, RL_API_MEMSET),
    DR(cuMemsetD8_v2, RL_API_MEMSET),
    DR(cuMemsetD32_v2, RL_API_MEMSET),
};
#define N_CBIDS (sizeof CBIDS / sizeof CBIDS[0])

/* ------------------------------------------------------------------------------------ */
/* enabling activity kinds (v1 global API, or v2 per-subscriber in multi-subscriber mode) */

static CUptiResult kind_set(CUpti_ActivityKind k, int on) {
    if (g_multi) return on ? C.Enable2(g_sub, k, NULL) : C.Disable2(g_sub, k, NULL);
    return on ? C.Enable(k) : C.Disable(k);
}

static CUptiResult api_set(const cbid_ent_t *e, int on) {
    if (e->domain == RL_DOMAIN_RUNTIME) {
        if (g_multi && C.EnableRuntimeApi2) return C.EnableRuntimeApi2(g_sub, e->cbid, (uint8_t)on);
        if (C.EnableRuntimeApi) return C.EnableRuntimeApi(e->cbid, (uint8_t)on);
    } else {
        if (g_multi && C.EnableDriverApi2) return C.EnableDriverApi2(g_sub, e->cbid, (uint8_t)on);
        if (C.EnableDriverApi) return C.EnableDriverApi(e->cbid, (uint8_t)on);
    }
    return CUPTI_ERROR_NOT_SUPPORTED;
}

static void report_enable(const char *what, int kind, CUptiResult r) {
    if (r == CUPTI_SUCCESS) return;
    if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED || r == CUPTI_ERROR_NOT_COMPATIBLE) {
        atomic_fetch_or(&g_flags, RL_FLAG_CONFLICT);
        rl_log("conflict: enabling %s %d failed (%s): another CUPTI user holds activity tracing", what, kind,
               cupti_err(r));
    } else {
        rl_log("enabling %s %d failed: %s (%d)", what, kind, cupti_err(r), (int)r);
    }
}

/* Switch collection mode. Called from InitializeInjection and from the sender thread on
 * a CONTROL message, never from a CUPTI callback. */
static void apply_mode(int mode, int initial) {
    static const CUpti_ActivityKind always[] = {
        CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
        CUPTI_ACTIVITY_KIND_MARKER, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION};
    atomic_store(&g_mode, mode);
    for (size_t i = 0; i < sizeof always / sizeof always[0]; i++) atomic_store(&g_our_kind[always[i]], 1);
    atomic_store(&g_our_kind[CUPTI_ACTIVITY_KIND_MARKER_DATA], mode == RL_MODE_DEEP);
    if (cfg.graph_level) atomic_store(&g_our_kind[CUPTI_ACTIVITY_KIND_GRAPH_TRACE], 1);
    if (!C.lib || g_test_mode || (atomic_load(&g_flags) & RL_FLAG_CONFLICT)) return;
    if (initial) {
        for (size_t i = 0; i < sizeof always / sizeof always[0]; i++)
            report_enable("activity kind", always[i], kind_set(always[i], 1));
        int missing_api = 0;
        for (size_t i = 0; i < N_CBIDS; i++)
            if (!CBIDS[i].deep_only) {
                CUptiResult r = api_set(&CBIDS[i], 1);
                if (r == CUPTI_ERROR_NOT_SUPPORTED) missing_api = 1;
                else if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) report_enable("runtime cbid", CBIDS[i].cbid, r);
                /* other errors: a cbid this libcupti does not know (older CUDA); harmless */
            }
        if (missing_api)
            rl_log("this libcupti cannot filter API records by cbid: launch threads and launch latency unavailable");
    }
    int deep = mode == RL_MODE_DEEP;
    if (!initial || deep) {
        report_enable("activity kind", CUPTI_ACTIVITY_KIND_MARKER_DATA, kind_set(CUPTI_ACTIVITY_KIND_MARKER_DATA, deep));
        for (size_t i = 0; i < N_CBIDS; i++)
            if (CBIDS[i].deep_only) (void)api_set(&CBIDS[i], deep);
        if (C.EnableLatencyTimestamps) (void)C.EnableLatencyTimestamps((uint8_t)deep);
    }
}

/* ------------------------------------------------------------------------------------ */
/* takeover by another CUPTI client (legacy CUPTI) and getting CUPTI back                */

static void takeover_detected(unsigned lost, const char *why) {
    atomic_fetch_add(&K.buffers_lost, lost);
    if (atomic_exchange(&g_taken_over, 1)) return;
    atomic_fetch_add(&K.takeovers, 1);
    atomic_fetch_or(&g_flags, RL_FLAG_TAKEN_OVER);
    rl_log("takeover: another CUPTI client (torch.profiler?) re-registered the activity buffer callbacks: %s "
           "(%u buffer(s) lost to it); Ridgeline records are paused until it is done", why, lost);
}

static void takeover_false_alarm(void) {
    if (!atomic_exchange(&g_taken_over, 0)) return;
    atomic_fetch_and(&g_flags, ~(unsigned)RL_FLAG_TAKEN_OVER);
    rl_log("resumed: CUPTI still returns buffers to Ridgeline (a long-running record held one back): no takeover");
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records);
static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size, size_t valid);

/* Sender thread: register our callbacks and kinds again (the other tool is done). Its
 * timestamp source, if it registered one, stays until CUPTI is finalized. */
static void reclaim(const char *why) {
    CUptiResult r = C.RegisterCallbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        rl_log("reclaim failed: cuptiActivityRegisterCallbacks: %s (%d); still paused", cupti_err(r), (int)r);
        return;
    }
    if (cfg.graph_level) (void)kind_set(CUPTI_ACTIVITY_KIND_GRAPH_TRACE, 1);
    apply_mode(atomic_load(&g_mode), 1);
    atomic_fetch_add(&K.reclaims, 1);
    atomic_store(&g_taken_over, 0);
    atomic_fetch_and(&g_flags, ~(unsigned)RL_FLAG_TAKEN_OVER);
    rl_log("resumed: %s; Ridgeline's buffer callbacks and activity kinds are registered again", why);
}

/* 1 when CUPTI says no client has kernel records enabled any more (CUPTI >= 13.2). */
static int kernels_disabled_everywhere(void) {
    if (!C.GetEnabledKinds) return 0;
    CUpti_ActivityKind kinds[256]; /* the size argument is a count; room for it as bytes too */
    uint32_t cap = 64, n = 0;
    if (C.GetEnabledKinds(NULL, kinds, &cap, &n) != CUPTI_SUCCESS) return 0;
    for (uint32_t i = 0; i < n && i < 64; i++)
        if (kinds[i] == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || kinds[i] == CUPTI_ACTIVITY_KIND_KERNEL) return 0;
    return 1;
}

/* CUPTI's timestamps are CLOCK_REALTIME nanoseconds by default (measured with the 12.4,
 * 12.8 and 13.0 libraries: tests/test_native_cupti_headers.py). A tool that registers its
 * own timestamp source (Kineto: cuptiActivityRegisterTimestampCallback, a TSC
 * approximation) moves every client's records onto it; cuptiGetTimestamp follows it
 * ("normalized to correspond with the ... activity records"). Watched each tick, a move
 * of more than RL_CLOCK_JUMP_NS is reported in a "clock:" status line. */
#define RL_CLOCK_JUMP_NS 1000000LL
#include "ridgeline_cupti_guest.c"

static int collecting(void) {
    return C.FlushAll && !g_test_mode && !(atomic_load(&g_flags) & (RL_FLAG_CONFLICT | RL_FLAG_NO_CUPTI));
}

/* Every flush period, on the sender thread (never in a CUPTI callback): deliver what
 * CUPTI has completed so a quiet process's records arrive within a period instead of
 * when a buffer fills, then look for a takeover, or for its end. */
static void sender_tick(uint64_t now) {
    if (!collecting()) return;
    /* the other client finalized CUPTI (seen exactly when preloaded): ours again */
    if (atomic_exchange(&g_cupti_finalized, 0)) reclaim("the other CUPTI client finalized CUPTI");
    CUptiResult r = C.FlushAll(0);
    atomic_fetch_add(&K.flushes, 1);
    clock_tick();
    if (g_multi) return; /* per-subscriber callbacks: nobody can take ours */
    if (!atomic_load(&g_taken_over)) {
        watch_takeover(now);
        return;
    }
    if (atomic_exchange(&g_reclaim_req, 0)) reclaim("the agent asked to reclaim CUPTI");
    else if (r == CUPTI_ERROR_NOT_INITIALIZED || r == CUPTI_ERROR_INVALID_OPERATION)
        reclaim("the other tool finalized CUPTI");
    else if (kernels_disabled_everywhere())
        reclaim("the other tool disabled its activity kinds (it stopped)");
}

/* ------------------------------------------------------------------------------------ */
/* sender thread                                                                         */

typedef struct {
    uint8_t *buf;
    size_t cap, len, sent;
    uint64_t records;
    uint64_t started_ms, progress_ms;
} outmsg_t;

static int grow(outmsg_t *m, size_t need) {
    if (m->len + need <= m->cap) return 0;
    size_t c = m->cap ? m->cap : 1 << 16;
    while (c < m->len + need) c *= 2;
    uint8_t *n = realloc(m->buf, c);
    if (!n) return -1;
    m->buf = n;
    m->cap = c;
    return 0;
}

static int put(outmsg_t *m, const void *p, size_t n) {
    if (grow(m, n + 8)) return -1;
    memcpy(m->buf + m->len, p, n);
    m->len += n;
    return 0;
}

static int pad8(outmsg_t *m) {
    static const uint8_t z[8] = {0};
    size_t r = m->len % 8;
    return r ? put(m, z, 8 - r) : 0;
}

static void frame_begin(outmsg_t *m, uint16_t type) {
    rl_frame_t f = {RL_MAGIC, type, RL_PROTO_VERSION, 0, 0};
    m->len = m->sent = 0;
    m->records = 0;
    put(m, &f, sizeof f);
}

static void frame_end(outmsg_t *m) {
    uint32_t body = (uint32_t)(m->len - sizeof(rl_frame_t));
    memcpy(m->buf + offsetof(rl_frame_t, length), &body, 4);
}

static void build_hello(outmsg_t *m) {
    char comm[256] = {0};
    FILE *f = fopen("/proc/self/comm", "r");
    if (f) {
        if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
        fclose(f);
        comm[strcspn(comm, "\n")] = 0;
    }
    char status[RL_STATUS_MAX];
    pthread_mutex_lock(&g_status_lock);
    memcpy(status, g_status, sizeof status);
    pthread_mutex_unlock(&g_status_lock);
    uint32_t n_sizes = 0;
    for (int k = 0; k < RL_KIND_MAX; k++) n_sizes += g_rec_size[k] != 0;
    rl_hello_t h = {(uint32_t)g_pid, g_cupti_version, CUPTI_API_VERSION, (uint32_t)atomic_load(&g_mode),
                    atomic_load(&g_flags), atomic_load(&g_sample_every), (uint32_t)strlen(comm),
                    (uint32_t)strlen(status), n_sizes, (uint32_t)N_CBIDS};
    frame_begin(m, RL_MSG_HELLO);
    put(m, &h, sizeof h);
    put(m, comm, h.comm_len);
    pad8(m);
    put(m, status, h.status_len);
    pad8(m);
    for (int k = 0; k < RL_KIND_MAX; k++)
        if (g_rec_size[k]) {
            rl_kind_size_t ks = {(uint32_t)k, g_rec_size[k]};
            put(m, &ks, sizeof ks);
        }
    for (size_t i = 0; i < N_CBIDS; i++) {
        rl_cbid_t c = {CBIDS[i].domain, CBIDS[i].cbid, CBIDS[i].category, (uint32_t)strlen(CBIDS[i].name)};
        put(m, &c, sizeof c);
        put(m, CBIDS[i].name, c.name_len);
        pad8(m);
    }
    frame_end(m);
}

static uint32_t g_names_sent; /* names already sent on the current connection (sender thread only) */

static int build_batch(outmsg_t *m, slot_t *s) {
    frame_begin(m, RL_MSG_BATCH);
    rl_batch_t b;
    memset(&b, 0, sizeof b);
    b.pid = (uint32_t)g_pid;
    b.cupti_version = g_cupti_version;
    b.seq = s->seq;
    b.mode = (uint32_t)atomic_load(&g_mode);
    b.flags = atomic_load(&g_flags);
    b.kernel_sample_every = atomic_load(&g_sample_every);
    b.n_devices = s->n_devices;
    b.n_sections = s->n_sections;
    b.records = s->records;
    b.dropped_cupti = atomic_load(&K.dropped_cupti);
    b.dropped_pool_full = atomic_load(&K.dropped_pool_full);
    b.dropped_no_agent = atomic_load(&K.dropped_no_agent);
    b.dropped_send = atomic_load(&K.dropped_send);
    b.sampled_out = atomic_load(&K.sampled_out);
    b.names_dropped = atomic_load(&K.names_dropped);
    b.walk_errors = atomic_load(&K.walk_errors);
    memcpy(b.device_ids, s->devices, sizeof b.device_ids);
    size_t hdr_at = m->len;
    if (put(m, &b, sizeof b)) return -1;
    pthread_mutex_lock(&g_names_lock);
    uint32_t upto = g_names_count;
    for (uint32_t i = g_names_sent; i < upto; i++) {
        name_ent_t *e = &g_names[g_name_order[i]];
        rl_name_t n = {(uint64_t)e->ptr, e->len, 0};
        if (put(m, &n, sizeof n) || put(m, g_strings + e->off, e->len) || pad8(m)) {
            pthread_mutex_unlock(&g_names_lock);
            return -1;
        }
    }
    pthread_mutex_unlock(&g_names_lock);
    uint32_t n_names = upto - g_names_sent;
    memcpy(m->buf + hdr_at + offsetof(rl_batch_t, n_names), &n_names, 4);
    if (put(m, s->data, s->used)) return -1;
    frame_end(m);
    m->records = s->records;
    g_names_sent = upto; /* if this message is later abandoned the connection is closed and all names resent */
    return 0;
}

/* Retry delays after a connect found the agent's backlog full (EAGAIN): the agent is there
 * but a connect flood (any local user can make one) holds its queue, so come back soon, not
 * after RIDGELINE_RECONNECT_MS (1 s; no agent at all) -- at most one attempt a 250 ms. */
#define RL_BUSY_RETRY_MIN_MS 10u
#define RL_BUSY_RETRY_MAX_MS 250u

/* A connected socket, or -1; *busy set when the agent's backlog was full (EAGAIN). */
static int connect_agent(int *busy) {
    *busy = 0;
    if (!cfg.socket_path[0]) return -1; /* refused at start-up (logged) */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, cfg.socket_path, strlen(cfg.socket_path));
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        /* EAGAIN (backlog full) and EINPROGRESS are treated as "not now": retry later */
        *busy = errno == EAGAIN || errno == EWOULDBLOCK;
        close(fd);
        return -1;
    }
    return fd;
}

static void handle_control(const uint8_t *body, uint32_t len) {
    if (len < sizeof(rl_control_t)) return;
    rl_control_t c;
    memcpy(&c, body, sizeof c);
    if (c.kernel_sample_every) atomic_store(&g_sample_every, c.kernel_sample_every > 1000000 ? 1000000 : c.kernel_sample_every);
    if ((c.mode == RL_MODE_ALWAYS_ON || c.mode == RL_MODE_DEEP) && (int)c.mode != atomic_load(&g_mode))
        apply_mode((int)c.mode, 0);
    if ((c.flags & RL_CONTROL_RECLAIM) && atomic_load(&g_taken_over)) atomic_store(&g_reclaim_req, 1);
}

/* Reads whatever control bytes are there; returns -1 when the agent closed. */
static int read_control(int fd, uint8_t *in, size_t *in_len, size_t in_cap) {
    for (;;) {
        ssize_t r = recv(fd, in + *in_len, in_cap - *in_len, MSG_DONTWAIT);
        if (r == 0) return -1;
        if (r < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
        *in_len += (size_t)r;
        for (;;) {
            if (*in_len < sizeof(rl_frame_t)) break;
            rl_frame_t f;
            memcpy(&f, in, sizeof f);
            if (f.magic != RL_MAGIC || f.length > in_cap - sizeof f) return -1; /* not our agent */
            if (*in_len < sizeof f + f.length) break;
            if (f.type == RL_MSG_CONTROL) handle_control(in + sizeof f, f.length);
            memmove(in, in + sizeof f + f.length, *in_len - sizeof f - f.length);
            *in_len -= sizeof f + f.length;
        }
        if (*in_len == in_cap) return -1;
    }
}

static void *sender_main(void *arg) {
    (void)arg;
    int fd = -1;
    uint64_t next_connect = 0;
    unsigned busy_ms = 0; /* the current retry delay while the agent's backlog is full */
    outmsg_t msg = {0};
    int pending = 0;
    uint8_t in[256];
    size_t in_len = 0;
    unsigned hello_gen = 0;
    uint64_t next_tick = now_ms() + cfg.flush_ms, drain_until = 0;
    while (!atomic_load(&g_stop)) {
        uint64_t now = now_ms();
        char wake;
        if (g_wake_pipe[0] >= 0 && read(g_wake_pipe[0], &wake, 1) == 1) {
            /* the process is being told to stop (SIGTERM): flush and ship now */
            if (collecting()) (void)C.FlushAll(0);
            drain_until = now + cfg.stop_flush_ms;
        } else if (cfg.flush_ms && now >= next_tick) {
            sender_tick(now);
            next_tick = now + cfg.flush_ms;
        }
        if (fd < 0 && now >= next_connect) {
            int busy;
            fd = connect_agent(&busy);
            if (busy) {
                atomic_fetch_add(&K.connects_busy, 1);
                busy_ms = busy_ms ? 2 * busy_ms : RL_BUSY_RETRY_MIN_MS;
                if (busy_ms > RL_BUSY_RETRY_MAX_MS) busy_ms = RL_BUSY_RETRY_MAX_MS;
                next_connect = now + (busy_ms < cfg.reconnect_ms ? busy_ms : cfg.reconnect_ms);
            } else {
                busy_ms = 0;
                next_connect = now + cfg.reconnect_ms;
            }
            if (fd >= 0) {
                atomic_fetch_add(&K.connects, 1);
                g_names_sent = 0;
                in_len = 0;
                hello_gen = atomic_load(&g_status_gen);
                build_hello(&msg);
                msg.started_ms = msg.progress_ms = now;
                pending = 1;
            }
        }
        if (!pending && fd >= 0 && atomic_load(&g_status_gen) != hello_gen) {
            /* flags or status changed (takeover, reclaim): tell the agent now */
            hello_gen = atomic_load(&g_status_gen);
            build_hello(&msg);
            msg.started_ms = msg.progress_ms = now_ms();
            pending = 1;
        }
        if (drain_until) {
            int idle = !pending;
            pthread_mutex_lock(&g_pool_lock);
            for (unsigned i = 0; idle && i < cfg.pool_slots; i++) idle = g_slots[i].state == SLOT_FREE;
            pthread_mutex_unlock(&g_pool_lock);
            if (idle || now_ms() >= drain_until) {
                drain_until = 0;
                ssize_t w = write(g_ack_pipe[1], "k", 1);
                (void)w;
            }
        }
        if (!pending) {
            /* take the oldest ready slot */
            slot_t *s = NULL;
            pthread_mutex_lock(&g_pool_lock);
            for (unsigned i = 0; i < cfg.pool_slots; i++)
                if (g_slots[i].state == SLOT_READY && (!s || g_slots[i].seq < s->seq)) s = &g_slots[i];
            if (!s) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 50 * 1000000L;
                if (ts.tv_nsec >= 1000000000L) {
                    ts.tv_sec++;
                    ts.tv_nsec -= 1000000000L;
                }
                pthread_cond_timedwait(&g_pool_cond, &g_pool_lock, &ts);
            }
            pthread_mutex_unlock(&g_pool_lock);
            if (s) {
                if (fd < 0) {
                    atomic_fetch_add(&K.dropped_no_agent, s->records);
                } else if (build_batch(&msg, s) == 0) {
                    msg.started_ms = msg.progress_ms = now_ms();
                    pending = 1;
                    atomic_store(&g_send_pending, 1); /* before the slot shows free */
                } else {
                    atomic_fetch_add(&K.dropped_send, s->records); /* out of memory for the message */
                }
                pthread_mutex_lock(&g_pool_lock);
                s->state = SLOT_FREE;
                pthread_mutex_unlock(&g_pool_lock);
            }
        }
        if (fd >= 0 && pending) {
            ssize_t w = send(fd, msg.buf + msg.sent, msg.len - msg.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (w > 0) {
                msg.sent += (size_t)w;
                msg.progress_ms = now_ms();
                if (msg.sent == msg.len) {
                    pending = 0;
                    if (msg.records) {
                        atomic_fetch_add(&K.records_sent, msg.records);
                        atomic_fetch_add(&K.batches_sent, 1);
                    }
                }
            } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                atomic_fetch_add(&K.dropped_send, msg.records);
                pending = 0;
                close(fd);
                fd = -1;
            } else if (now_ms() - msg.progress_ms > cfg.stall_ms) {
                /* agent accepts nothing: give up on it; the next connection starts clean */
                atomic_fetch_add(&K.dropped_send, msg.records);
                pending = 0;
                close(fd);
                fd = -1;
            }
        }
        if (fd >= 0 && read_control(fd, in, &in_len, sizeof in) < 0) {
            if (pending) atomic_fetch_add(&K.dropped_send, msg.records);
            pending = 0;
            close(fd);
            fd = -1;
        }
        if (fd >= 0 && pending && msg.sent < msg.len) {
            struct pollfd pfd = {fd, POLLOUT | POLLIN, 0};
            (void)poll(&pfd, 1, 20);
        } else if (fd < 0 && pending) {
            pending = 0;
        }
        atomic_store(&g_send_pending, pending);
    }
    atomic_store(&g_send_pending, 0);
    if (fd >= 0) close(fd);
    free(msg.buf);
    return NULL;
}

static pthread_mutex_t g_start_lock = PTHREAD_MUTEX_INITIALIZER;

static void start_sender_if_needed(void) {
    if (atomic_load(&g_sender_running) || !atomic_load(&g_active) || atomic_load(&g_exiting)) return;
    pthread_mutex_lock(&g_start_lock);
    if (!atomic_load(&g_sender_running) && !atomic_load(&g_exiting)) {
        atomic_store(&g_stop, 0);
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setstacksize(&at, 256 << 10);
        /* Block every signal in our thread: the application's handlers must run on its own threads. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        if (pthread_create(&g_sender, &at, sender_main, NULL) == 0) atomic_store(&g_sender_running, 1);
        else rl_log("cannot start the sender thread; records will be dropped");
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&at);
    }
    pthread_mutex_unlock(&g_start_lock);
}

static int alloc_pool(void) {
    g_slot_cap = cfg.buffer_bytes + RL_KIND_MAX * sizeof(rl_section_t);
    g_slots = calloc(cfg.pool_slots, sizeof *g_slots);
    if (!g_slots) return -1;
    for (unsigned i = 0; i < cfg.pool_slots; i++) {
        g_slots[i].data = malloc(g_slot_cap);
        if (!g_slots[i].data) return -1;
    }
    return names_alloc();
}

/* fork(): our locks are taken around the fork so a child never inherits one held by a
 * thread that does not exist there (it would wait forever on it). */
static void at_fork_prepare(void) {
    pthread_mutex_lock(&g_start_lock);
    pthread_mutex_lock(&g_pool_lock);
    pthread_mutex_lock(&g_names_lock);
    pthread_mutex_lock(&g_status_lock);
}

static void at_fork_parent(void) {
    pthread_mutex_unlock(&g_status_lock);
    pthread_mutex_unlock(&g_names_lock);
    pthread_mutex_unlock(&g_pool_lock);
    pthread_mutex_unlock(&g_start_lock);
}

static void at_fork_child(void) {
    at_fork_parent();
    /* Threads do not survive fork; the first buffer completed in the child restarts the sender. */
    atomic_store(&g_sender_running, 0);
    g_pid = getpid();
    /* pipes shared with the parent would cross its signals and peeks with ours */
    for (int i = 0; i < 2; i++) {
        if (g_wake_pipe[i] >= 0) close(g_wake_pipe[i]);
        if (g_ack_pipe[i] >= 0) close(g_ack_pipe[i]);
        if (g_peek_pipe[i] >= 0) close(g_peek_pipe[i]);
        g_wake_pipe[i] = g_ack_pipe[i] = g_peek_pipe[i] = -1;
    }
    if (make_pipe(g_peek_pipe)) g_peek_pipe[0] = g_peek_pipe[1] = -1;
}

static int g_init_pid;

/* After our atexit handler come libcupti's and the driver's static destructors (the real
 * libcupti.so.12/13 have C++ ones): the sender must not tick a flush into them, nor be
 * started again by a buffer CUPTI completes later. It is told to stop and joined, bounded
 * (each loop turn waits at most ~50 ms, plus a flush); past the bound it is left as it is
 * rather than holding up the exit. */
static void stop_sender_at_exit(void) {
    /* a buffer CUPTI completes later (context teardown) must not start a new sender */
    atomic_store(&g_exiting, 1);
    if (!atomic_load(&g_sender_running)) return;
    atomic_store(&g_stop, 1);
    pthread_mutex_lock(&g_pool_lock);
    pthread_cond_broadcast(&g_pool_cond);
    pthread_mutex_unlock(&g_pool_lock);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    if (pthread_timedjoin_np(g_sender, NULL, &until) == 0) atomic_store(&g_sender_running, 0);
}

static void at_exit(void) {
    if (!atomic_load(&g_active)) return;
    /* A forked child inherits this handler but not CUDA: it must not touch CUPTI or wait. */
    if (getpid() != g_init_pid) return;
    /* Completed buffers only (flag 0): a forced flush hands back running kernels with end=0. */
    if (cfg.exit_flush && collecting()) (void)C.FlushAll(0);
    /* give the sender a short, bounded chance to ship what is queued */
    uint64_t until = now_ms() + cfg.stop_flush_ms;
    while (now_ms() < until && atomic_load(&g_sender_running)) {
        int busy = 0;
        pthread_mutex_lock(&g_pool_lock);
        for (unsigned i = 0; i < cfg.pool_slots; i++) busy |= g_slots[i].state != SLOT_FREE;
        pthread_mutex_unlock(&g_pool_lock);
        /* a batch taken from its slot may still be on its way out */
        if (!busy && !atomic_load(&g_send_pending)) break;
        usleep(5000);
    }
    stop_sender_at_exit();
}

/* SIGTERM. A process without a SIGTERM handler of its own (SIG_DFL: a TP worker killed by
 * its launcher) dies without running atexit, losing the partial buffers. Only in that
 * case do we install a handler, and it keeps the default's meaning: it wakes the sender
 * (write(2), async-signal-safe), waits at most RIDGELINE_STOP_FLUSH_MS for it to flush
 * and ship (poll(2)), puts SIG_DFL back and re-raises, so the process still dies of
 * SIGTERM, just that much later. A handler the application installs before or after us
 * is never touched or wrapped (it decides; a normal exit then runs our atexit flush). */
static struct sigaction g_prev_term;
static pid_t g_term_pid;

static void on_sigterm(int sig) {
    int saved = errno;
    if (getpid() == g_term_pid && atomic_load(&g_sender_running)) {
        char c = 1;
        char drain[64];
        while (read(g_ack_pipe[0], drain, sizeof drain) > 0) {
        }
        if (write(g_wake_pipe[1], &c, 1) == 1) {
            struct pollfd p = {g_ack_pipe[0], POLLIN, 0};
            (void)poll(&p, 1, (int)cfg.stop_flush_ms + 100);
        }
    }
    sigaction(sig, &g_prev_term, NULL);
    errno = saved;
    raise(sig); /* blocked while we run: delivered, with the default action, on return */
}

static void install_sigterm(void) {
    struct sigaction cur;
    if (!cfg.sigterm_flush || sigaction(SIGTERM, NULL, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) || cur.sa_handler != SIG_DFL) return; /* the application's own */
    if (g_wake_pipe[0] < 0 && make_pipe(g_wake_pipe)) return;
    if (g_ack_pipe[0] < 0 && make_pipe(g_ack_pipe)) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigterm;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    g_prev_term = cur;
    g_term_pid = getpid();
    sigaction(SIGTERM, &sa, NULL);
}

/* ------------------------------------------------------------------------------------ */
/* loading libcupti                                                                      */

static void *self_dir_lib(const char *name, char *tried, size_t tried_cap) {
    Dl_info info;
    if (!dladdr((void *)&self_dir_lib, &info) || !info.dli_fname) return NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s", info.dli_fname);
    char *slash = strrchr(path, '/');
    if (!slash) return NULL;
    snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "%s", name);
    size_t u = strlen(tried);
    snprintf(tried + u, tried_cap - u, "%s%s", u ? ", " : "", path);
    return dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

static void *load_cupti(char *why, size_t why_cap) {
    static const char *sonames[] = {"libcupti.so.13", "libcupti.so.12", "libcupti.so"};
    char tried[1536] = {0};
    void *h;
    /* One CUPTI instance per process: reuse a libcupti the application already loaded
     * (torch links one); a second copy would collide with its subscriber. */
    for (size_t i = 0; i < 3; i++)
        if ((h = dlopen(sonames[i], RTLD_NOW | RTLD_NOLOAD))) return h;
    const char *env = getenv("RIDGELINE_LIBCUPTI");
    if (env && *env) {
        h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (h) return h;
        snprintf(why, why_cap, "RIDGELINE_LIBCUPTI=%s cannot be loaded: %s", env, dlerror());
        return NULL;
    }
    for (size_t i = 0; i < 3; i++) {
        size_t u = strlen(tried);
        snprintf(tried + u, sizeof tried - u, "%s%s", u ? ", " : "", sonames[i]);
        if ((h = dlopen(sonames[i], RTLD_NOW | RTLD_LOCAL))) return h;
    }
    if ((h = self_dir_lib("libcupti.so.13", tried, sizeof tried))) return h;
    static const char *paths[] = {"/usr/local/cuda/extras/CUPTI/lib64/libcupti.so",
                                  "/usr/local/cuda/lib64/libcupti.so"};
    for (size_t i = 0; i < 2; i++) {
        size_t u = strlen(tried);
        snprintf(tried + u, sizeof tried - u, ", %s", paths[i]);
        if ((h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL))) return h;
    }
    snprintf(why, why_cap, "libcupti not found (tried %s; set RIDGELINE_LIBCUPTI)", tried);
    return NULL;
}

#define SYM(field, name) (C.field = (__typeof__(C.field))dlsym(C.lib, name))

static int resolve_cupti(char *why, size_t why_cap) {
    SYM(GetVersion, "cuptiGetVersion");
    SYM(RegisterCallbacks, "cuptiActivityRegisterCallbacks");
    SYM(Enable, "cuptiActivityEnable");
    SYM(Disable, "cuptiActivityDisable");
    SYM(GetNextRecord, "cuptiActivityGetNextRecord");
    SYM(GetNumDropped, "cuptiActivityGetNumDroppedRecords");
    SYM(FlushAll, "cuptiActivityFlushAll");
    SYM(FlushPeriod, "cuptiActivityFlushPeriod");
    SYM(EnableRuntimeApi, "cuptiActivityEnableRuntimeApi");
    SYM(EnableDriverApi, "cuptiActivityEnableDriverApi");
    SYM(EnableLatencyTimestamps, "cuptiActivityEnableLatencyTimestamps");
    SYM(Subscribe, "cuptiSubscribe");
    SYM(Subscribe2, "cuptiSubscribe_v2");
    SYM(Unsubscribe, "cuptiUnsubscribe");
    SYM(StructSize, "cuptiActivityGetStructSize");
    SYM(GetResultString, "cuptiGetResultString");
    SYM(RegisterCallbacks2, "cuptiActivityRegisterCallbacks_v2");
    SYM(Enable2, "cuptiActivityEnable_v2");
    SYM(Disable2, "cuptiActivityDisable_v2");
    SYM(EnableRuntimeApi2, "cuptiActivityEnableRuntimeApi_v2");
    SYM(EnableDriverApi2, "cuptiActivityEnableDriverApi_v2");
    SYM(GetAttribute2, "cuptiActivityGetAttribute_v2");
    SYM(GetNumDropped2, "cuptiActivityGetNumDroppedRecords_v2");
    SYM(GetEnabledKinds, "cuptiActivityGetEnabledKinds");
    SYM(GetTimestamp, "cuptiGetTimestamp");
    SYM(SetAttribute, "cuptiActivitySetAttribute");
    if (!C.GetVersion || !C.RegisterCallbacks || !C.Enable || !C.Disable || !C.GetNextRecord || !C.Subscribe ||
        !C.Unsubscribe) {
        snprintf(why, why_cap, "the loaded libcupti lacks the activity API entry points");
        return -1;
    }
    return 0;
}

/* Claim or probe CUPTI. Returns 0 when we may trace, 1 on a conflict (reported). */
static int claim_cupti(void) {
    char old[RL_OLD_SUBSCRIBER_NAME_MIN_LEN * 2] = {0};
    CUptiResult r;
    if (C.Subscribe2 && C.RegisterCallbacks2 && C.Enable2 && C.Disable2) {
        /* Multi-subscriber mode (CUDA >= 13.2 with r610+ drivers): coexist with torch.profiler. */
        rl_subscriber_params_t p;
        memset(&p, 0, sizeof p);
        p.structSize = sizeof p;
        p.subscriberName = "ridgeline";
        p.oldSubscriberName = old;
        p.oldSubscriberSize = sizeof old;
        p.allowMultipleSubscribers = 1;
        r = C.Subscribe2(&g_sub, subscriber_callback, NULL, &p);
        if (r == CUPTI_SUCCESS) {
            /* Trust but verify: holding a subscriber in single-subscriber mode would make
             * torch.profiler's own subscribe fail later, so keep it only if CUPTI says
             * multiple subscribers are really on. */
            uint8_t state = 0;
            size_t sz = sizeof state;
            CUptiResult ar = C.GetAttribute2 ? C.GetAttribute2(g_sub, (CUpti_ActivityAttribute)RL_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE,
                                                               &sz, &state)
                                             : CUPTI_ERROR_NOT_SUPPORTED;
            /* A state that cannot be read means legacy: holding the one legacy subscriber
             * would make torch.profiler's (Kineto's cuptiSubscribe) fail, silently. */
            if (ar != CUPTI_SUCCESS || state != 1) {
                if (ar != CUPTI_SUCCESS)
                    rl_log("multi-subscriber state unreadable (cuptiActivityGetAttribute_v2: %s (%d)): "
                           "taken as legacy single-subscriber CUPTI", cupti_err(ar), (int)ar);
                (void)C.Unsubscribe(g_sub);
                g_sub = NULL;
                return 0; /* legacy v1 path, as below */
            }
            g_multi = 1;
            atomic_fetch_or(&g_flags, RL_FLAG_MULTI_SUBSCRIBER);
            return 0;
        }
        if (r != CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
            rl_log("CUPTI collection off: cuptiSubscribe_v2 failed: %s (%d) (no usable CUDA driver?)", cupti_err(r), (int)r);
            return 2;
        }
        /* Legacy single-subscriber CUPTI: is anyone else there? */
        memset(old, 0, sizeof old);
        p.allowMultipleSubscribers = 0;
        r = C.Subscribe2(&g_sub, subscriber_callback, NULL, &p);
    } else {
        r = C.Subscribe(&g_sub, subscriber_callback, NULL);
    }
    if (r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) {
        atomic_fetch_or(&g_flags, RL_FLAG_CONFLICT);
        rl_log("conflict: another CUPTI subscriber is active (%s); Ridgeline stays passive to not break it",
               old[0] ? old : "name unknown");
        return 1;
    }
    if (r != CUPTI_SUCCESS) {
        rl_log("CUPTI collection off: cuptiSubscribe failed: %s (%d) (no usable CUDA driver?)", cupti_err(r), (int)r);
        return 2;
    }
    /* Release at once: holding the single legacy subscriber would make torch.profiler's
     * one-shot subscribe fail later and silently yield no GPU events. The v1 activity API
     * we use next is process-global and needs no subscriber. */
    (void)C.Unsubscribe(g_sub);
    g_sub = NULL;
    return 0;
}

/* Bounds the device memory CUPTI takes per context (see read_config). We run inside
 * cuInit, before any context exists, so the bound holds for every context. */
static void set_device_buffer_pool_limit(void) {
    if (!cfg.device_buffer_pool_limit) return;
    if (!C.SetAttribute) {
        rl_log("device buffer pool left at CUPTI's default: libcupti has no cuptiActivitySetAttribute");
        return;
    }
    size_t v = cfg.device_buffer_pool_limit, sz = sizeof v;
    CUptiResult r = C.SetAttribute(CUPTI_ACTIVITY_ATTR_DEVICE_BUFFER_POOL_LIMIT, &sz, &v);
    if (r != CUPTI_SUCCESS)
        rl_log("device buffer pool limit %zu not set: %s (%d)", v, cupti_err(r), (int)r);
}

static int setup_collection(void) {
    CUptiResult r;
    if (g_multi) r = C.RegisterCallbacks2(g_sub, buffer_requested2, buffer_completed2);
    else r = C.RegisterCallbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        report_enable("buffer callbacks", 0, r);
        return -1;
    }
    guest_adopt();
    set_device_buffer_pool_limit();
    if (cfg.graph_level) {
        /* Global and irreversible (CUPTI cannot return to node level): configuration only. */
        r = kind_set(CUPTI_ACTIVITY_KIND_GRAPH_TRACE, 1);
        if (r == CUPTI_SUCCESS) atomic_fetch_or(&g_flags, RL_FLAG_GRAPH_LEVEL);
        else report_enable("activity kind", CUPTI_ACTIVITY_KIND_GRAPH_TRACE, r);
    }
    apply_mode(cfg.initial_mode, 1);
    if (C.FlushPeriod && cfg.flush_ms) (void)C.FlushPeriod(cfg.flush_ms);
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* exported entry points                                                                 */

/* CUPTI is off in this process: still tell the agent why (HELLO with the status line and
 * RL_FLAG_NO_CUPTI), so `ridgeline check` shows it. The sender is all that runs. */
static int report_only(void) {
    g_init_pid = getpid();
    pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    atomic_store(&g_active, 1);
    start_sender_if_needed();
    return 1;
}

static int common_init(void) {
    read_config();
    if (g_peek_pipe[0] < 0 && make_pipe(g_peek_pipe)) g_peek_pipe[0] = g_peek_pipe[1] = -1;
    g_cbufs_cap = cfg.max_cupti_buffers * 2;
    g_cbufs = calloc(g_cbufs_cap, sizeof *g_cbufs);
    g_pid = getpid();
    atomic_store(&g_sample_every, cfg.kernel_sample_every);
    atomic_store(&g_mode, cfg.initial_mode);
    if (alloc_pool()) {
        rl_log("out of memory for the record pool; Ridgeline CUPTI collection off");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* which descendants are collected (docs/cupti.md, "Which processes are collected")      */

/* The environment reaches every descendant. Those matched here are left alone (no CUPTI,
 * no agent connection): Inductor's compile workers (torch/_inductor/compile_worker/
 * subproc_pool.py starts `python .../compile_worker/__main__.py`; older releases
 * `python -m torch._inductor.compile_worker`) and its autotune workers
 * (torch/_inductor/autotune_process.py starts `python .../__autotune_main__.py`), whose
 * kernel timings would otherwise be taken under CUPTI's overhead. Engine workers (vLLM's
 * and SGLang's multiprocessing children) match nothing and are collected.
 * RIDGELINE_INJECT_SKIP=a;b;... replaces the list ("" collects every process); an entry
 * matches an argument among the first RL_SKIP_ARGS that ends with it.
 * Kept equal to DEFAULT_SKIP of probes/cupti/injection_policy.py (tests check). */
#define RL_DEFAULT_SKIP                                                                  \
    "torch/_inductor/compile_worker/__main__.py;torch._inductor.compile_worker;"         \
    "torch/_inductor/__autotune_main__.py;torch._inductor.autotune_process"
#define RL_SKIP_ARGS 4

/* 1 when the policy leaves this process alone; why names the matching entry. */
static int policy_skips(char *why, size_t why_cap) {
    const char *list = getenv("RIDGELINE_INJECT_SKIP");
    if (!list) list = RL_DEFAULT_SKIP;
    if (!*list) return 0;
    char args[8192];
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, args, sizeof args - 1);
    close(fd);
    if (n <= 0) return 0;
    args[n] = 0;
    const char *a = args + strlen(args) + 1; /* argv[1] */
    for (int i = 0; i < RL_SKIP_ARGS && a < args + n; i++, a += strlen(a) + 1) {
        size_t la = strlen(a);
        for (const char *e = list; *e;) {
            size_t le = strcspn(e, ";");
            if (le && le <= la && !strncmp(a + la - le, e, le)) {
                snprintf(why, why_cap, "%.*s", (int)le, e);
                return 1;
            }
            e += le + (e[le] == ';');
        }
    }
    return 0;
}

static int g_skipped = -1; /* -1 not decided yet */

static int skipped_by_policy(void) {
    if (g_skipped < 0) {
        char why[512] = {0};
        g_skipped = policy_skips(why, sizeof why);
        if (g_skipped && !getenv("RIDGELINE_QUIET"))
            fprintf(stderr, "ridgeline-cupti[%d]: not collected: this process matches \"%s\" of the injection "
                            "policy (RIDGELINE_INJECT_SKIP)\n", (int)getpid(), why);
    }
    return g_skipped;
}

/* Called by the CUDA driver during cuInit. Always returns 1: whatever happens here, the
 * application continues, with or without Ridgeline. */
RL_EXPORT int InitializeInjection(void) {
    if (atomic_exchange(&g_initialized, 1)) return 1;
    const char *dis = getenv("RIDGELINE_DISABLE");
    if (dis && *dis && strcmp(dis, "0")) return 1;
    if (skipped_by_policy()) return 1;
    if (common_init()) return 1;
    const char *nvtx_owner;
    if (foreign_injection("NVTX_INJECTION64_PATH", &nvtx_owner))
        rl_log("NVTX_INJECTION64_PATH=%s names another tool: NVTX ranges go to it, not to Ridgeline, and steps "
               "are cut from the kernels alone", nvtx_owner);
    char why[2048] = {0};
    if (!C.lib && !(C.lib = load_cupti(why, sizeof why))) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        rl_log("CUPTI collection off: %s; the application runs without Ridgeline", why);
        return report_only();
    }
    if (resolve_cupti(why, sizeof why)) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        rl_log("CUPTI collection off: %s", why);
        return report_only();
    }
    CUptiResult r = C.GetVersion(&g_cupti_version);
    if (r != CUPTI_SUCCESS) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        rl_log("CUPTI collection off: cuptiGetVersion failed: %s (%d) (no usable CUDA driver?)", cupti_err(r), (int)r);
        return report_only();
    }
    sizes_for_runtime(g_cupti_version);
    Dl_info di;
    rl_log("using %s (CUPTI version %u, headers %u)",
           dladdr((void *)C.GetVersion, &di) && di.dli_fname ? di.dli_fname : "libcupti", g_cupti_version,
           (unsigned)CUPTI_API_VERSION);
    int claim = claim_cupti();
    if (claim == 2) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        return report_only();
    }
    if (claim == 0 && setup_collection() != 0) atomic_fetch_or(&g_flags, RL_FLAG_CONFLICT);
    g_init_pid = getpid();
    pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    atexit(at_exit);
    if (claim == 0) install_sigterm();
    atomic_store(&g_active, 1);
    start_sender_if_needed(); /* also on conflict: the agent learns why there is no data */
    return 1;
}

/* NVTX_INJECTION64_PATH may name this library: forward NVTX to the libcupti we use, so
 * NVTX ranges arrive as MARKER records in the same CUPTI instance. */
RL_EXPORT int InitializeInjectionNvtx2(void *get_export_table) {
    char why[2048] = {0};
    const char *dis = getenv("RIDGELINE_DISABLE");
    if (dis && *dis && strcmp(dis, "0")) return 0;
    if (skipped_by_policy()) return 0;
    if (!C.lib && !(C.lib = load_cupti(why, sizeof why))) {
        rl_log("NVTX forwarding off: %s", why);
        return 0;
    }
    fn_NvtxInit f = (fn_NvtxInit)dlsym(C.lib, "InitializeInjectionNvtx2");
    if (!f) {
        rl_log("NVTX forwarding off: libcupti has no InitializeInjectionNvtx2");
        return 0;
    }
    return f(get_export_table);
}

/* NVTX extensions (payloads, counters, memory: nvtxExtImplInit.h of NVTX 3) look up
 * InitializeInjectionNvtxExtension in the library NVTX_INJECTION64_PATH names, not
 * InitializeInjectionNvtx2: forwarded the same way, to the libcupti that exports it
 * (13.x does; 12.x does not, and the extension then stays off, as without Ridgeline). */
typedef int (*fn_NvtxExtInit)(void *);
RL_EXPORT int InitializeInjectionNvtxExtension(void *export_function) {
    char why[2048] = {0};
    const char *dis = getenv("RIDGELINE_DISABLE");
    if (dis && *dis && strcmp(dis, "0")) return 0;
    if (skipped_by_policy()) return 0;
    if (!C.lib && !(C.lib = load_cupti(why, sizeof why))) {
        rl_log("NVTX extension forwarding off: %s", why);
        return 0;
    }
    fn_NvtxExtInit f = (fn_NvtxExtInit)dlsym(C.lib, "InitializeInjectionNvtxExtension");
    if (!f) {
        rl_log("NVTX extension forwarding off: libcupti has no InitializeInjectionNvtxExtension");
        return 0;
    }
    return f(export_function);
}

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
RL_EXPORT const char *ridgeline_test_skip_default(void) { return RL_DEFAULT_SKIP; }
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

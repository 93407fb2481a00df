/* Internal to libridgeline_cupti.so: what its parts (ridgeline_cupti*.c) share. Never
 * installed; every name here is hidden (-fvisibility=hidden), only RL_EXPORT symbols are
 * exported. */
#ifndef RIDGELINE_CUPTI_INTERNAL_H
#define RIDGELINE_CUPTI_INTERNAL_H
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
#include "ridgeline_cupti_guest.h"

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

#define RL_KIND_MAX 64
/* Memory the library may hold in the served process: the record pool (pool slots x buffer
 * size) and the buffers handed to CUPTI (outstanding buffers x buffer size). */
#define RL_MAX_POOL_BYTES ((size_t)1 << 30)
#define RL_MAX_CUPTI_BYTES ((size_t)2 << 30)
#define RL_NAME_MAX_LEN 4096          /* = MAX_NAME_BYTES of probes/cupti/protocol.py */
#define RL_NAME_HASH_MAX (1u << 20)   /* bytes of a long name hashed, bounding the time spent */
#define RL_STATUS_MAX 2048

/* CUPTI's timestamps are CLOCK_REALTIME nanoseconds by default (measured with the 12.4,
 * 12.8 and 13.0 libraries: tests/test_native_cupti_headers.py). A tool that registers its
 * own timestamp source (Kineto: cuptiActivityRegisterTimestampCallback, a TSC
 * approximation) moves every client's records onto it; cuptiGetTimestamp follows it
 * ("normalized to correspond with the ... activity records"). Watched each tick, a move
 * of more than RL_CLOCK_JUMP_NS is reported in a "clock:" status line. */
#define RL_CLOCK_JUMP_NS 1000000LL

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

/* libcupti entry points, resolved with dlsym (ridgeline_cupti_collect.c) */
struct rl_cupti {
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
};
extern struct rl_cupti C;

/* configuration, from the environment, read once (ridgeline_cupti_config.c) */
struct rl_config {
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
};
extern struct rl_config cfg;

/* counters sent to the agent in every HELLO and BATCH */
struct rl_counters {
    atomic_uint_fast64_t dropped_cupti, dropped_pool_full, dropped_no_agent, dropped_send, sampled_out,
        names_dropped, walk_errors, records_in, records_sent, batches_sent, connects, buffers_refused,
        buffers_lost, flushes, takeovers, reclaims, connects_busy;
};
extern struct rl_counters K;

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

#define N_CBIDS rl_n_cbids
typedef struct {
    uint8_t *buf;
    size_t cap, len, sent;
    uint64_t records;
    uint64_t started_ms, progress_ms;
} outmsg_t;

typedef struct {
    uint8_t *buf;
    uint64_t written_since_ms; /* first tick at which CUPTI had written into it; 0 = not yet */
    uint32_t ticks;            /* consecutive flushes it was written and not returned */
    int lost;                  /* counted as taken by another client */
    uint64_t seq;              /* order handed out: the newest is CUPTI's current buffer */
} cbuf_t;

typedef struct {
    uint32_t domain, cbid, category;
    const char *name;
    int deep_only;
} cbid_ent_t;

/* Every name declared below is internal to the library: hidden, so that the compiler reaches
 * it directly from any part, as it did a static of one file (-fvisibility=hidden covers only
 * definitions, not these declarations). */
#pragma GCC visibility push(hidden)

/* ---- state shared by the parts (defined in the file of their concern) ---- */
extern const char rl_default_skip[]; /* RL_DEFAULT_SKIP of ridgeline_cupti.c */
extern pthread_mutex_t g_pool_lock;
extern pthread_cond_t g_pool_cond;
extern pthread_mutex_t g_names_lock;
extern pthread_mutex_t g_status_lock;
extern slot_t *g_slots;
extern size_t g_slot_cap;
extern uint64_t g_seq;
extern name_ent_t *g_names;
extern uint32_t g_names_cap;
extern uint32_t g_names_count;
extern uint32_t *g_name_order;
extern uint32_t g_names_max;
extern char *g_strings;
extern size_t g_strings_used, g_strings_cap, g_strings_max;
extern uint32_t g_rec_size[RL_KIND_MAX];
extern int g_walk_with_cupti;
extern atomic_int g_initialized;
extern atomic_int g_active;
extern atomic_int g_sender_running;
extern atomic_int g_stop;
extern atomic_int g_mode;
extern atomic_uint g_sample_every;
extern atomic_uint g_flags;
extern uint32_t g_cupti_version;
extern pthread_t g_sender;
extern CUpti_SubscriberHandle g_sub;
extern int g_multi;
extern int g_test_mode;
extern int g_pid;
extern atomic_int g_outstanding_buffers;
extern atomic_uint_fast64_t g_kernel_counter;
extern atomic_int g_warned_kernel_layout;
extern char g_status[RL_STATUS_MAX];
extern atomic_uint g_status_gen;
extern atomic_int g_taken_over;
extern atomic_int g_reclaim_req;
extern atomic_int g_send_pending;
extern atomic_int g_exiting;
extern int g_wake_pipe[2];
extern int g_ack_pipe[2];
extern atomic_int g_cupti_finalized;
extern atomic_uchar g_our_kind[RL_KIND_MAX];
extern atomic_uint_fast64_t g_sinks_handed;
extern cbuf_t *g_cbufs;
extern unsigned g_cbufs_cap;
extern int g_peek_pipe[2];
extern const cbid_ent_t CBIDS[];
extern const size_t rl_n_cbids; /* entries of CBIDS */
extern pthread_mutex_t g_start_lock;
extern uint32_t g_names_sent;
extern int g_init_pid;
extern atomic_uint_fast64_t g_clock_mapped, g_clock_unmapped, g_clock_pairs;
extern atomic_uint_fast64_t g_guest_records, g_guest_buffers, g_guest_sessions, g_guest_dropped;

/* ---- functions shared by the parts ---- */
int common_init(void);
void rl_log(const char *fmt, ...);
const char *cupti_err(CUptiResult r);
uint64_t now_ms(void);
long env_long(const char *name, long dflt, long lo, long hi);
void set_socket_path(const char *p);
void read_config(void);
int names_alloc(void);
void sizes_from_header(void);
void sizes_for_runtime(uint32_t version);
size_t record_size(uint8_t *buf, size_t valid, uint8_t *p);
void process_buffer(uint8_t *buf, size_t valid);
void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records);
void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size,
                                      size_t valid);
void CUPTIAPI buffer_requested2(uint8_t **buffer, size_t *size, size_t *max_records,
                                       void *info);
void CUPTIAPI buffer_completed2(uint8_t *buffer, size_t size, size_t valid,
                                       void *info);
void CUPTIAPI subscriber_callback(void *ud, CUpti_CallbackDomain d, CUpti_CallbackId id, const void *data);
int make_pipe(int p[2]);
void cbuf_add(uint8_t *b);
int cbuf_remove(uint8_t *b);
int cbuf_known(uint8_t *b);
void watch_takeover(uint64_t now);
unsigned cbufs_all_lost(void);
void takeover_detected(unsigned lost, const char *why);
void takeover_false_alarm(void);
void reclaim(const char *why);
int kernels_disabled_everywhere(void);
CUptiResult kind_set(CUpti_ActivityKind k, int on);
CUptiResult api_set(const cbid_ent_t *e, int on);
void apply_mode(int mode, int initial);
void *load_cupti(char *why, size_t why_cap);
int resolve_cupti(char *why, size_t why_cap);
int claim_cupti(void);
int setup_collection(void);
int collecting(void);
void start_sender_if_needed(void);
void build_hello(outmsg_t *m);
int build_batch(outmsg_t *m, slot_t *s);
int alloc_pool(void);
void at_fork_prepare(void);
void at_fork_parent(void);
void at_fork_child(void);
void at_exit(void);
void install_sigterm(void);
void clock_snapshot(rl_clock_map_t *out);
void clock_tick(void);
void guest_tee(uint8_t *buf, size_t valid);
int guest_own_buffer(uint8_t *buf, size_t size, size_t valid);
int foreign_injection(const char *var, const char **owner);
void guest_adopt(void);

/* ---- per record of the completed-buffer path (ridgeline_cupti_pool.c), inline: called for
 * every record, where a call into another file costs what the copy does ---- */

/* name interning (ridgeline_cupti_names.c): a pointer seen before costs one probe */
void intern_new(uintptr_t ptr, uint32_t h);
static inline void intern_ptr(uintptr_t ptr) {
    if (!ptr) return;
    uint32_t mask = g_names_cap - 1;
    uint32_t h = (uint32_t)((ptr >> 3) * 0x9E3779B97F4A7C15ull >> 32) & mask;
    while (g_names[h].ptr) {
        if (g_names[h].ptr == ptr) return;
        h = (h + 1) & mask;
    }
    intern_new(ptr, h);
}

/* timestamps and sharing (ridgeline_cupti_guest.c) */
extern atomic_int g_guest_seen;
extern uint8_t g_our_cbid[2][4096]; /* [driver?][cbid] */

/* Field offsets of the timestamps of each record kind Ridgeline ships (the same in every
 * layout of CUDA 12.4 .. 13.5; checked against the header built with in
 * ridgeline_cupti_guest.c). */
static inline const uint8_t *ts_offsets(int kind, int *n) {
    static const uint8_t kernel[] = {16, 24, 32, 120, 128}, span16[] = {16, 24}, span8[] = {8, 16}, one8[] = {8};
    switch (kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: *n = 5; return kernel;
    case CUPTI_ACTIVITY_KIND_MEMCPY:
    case CUPTI_ACTIVITY_KIND_MEMSET: *n = 2; return span16;
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API:
    case CUPTI_ACTIVITY_KIND_GRAPH_TRACE: *n = 2; return span8;
    case CUPTI_ACTIVITY_KIND_MARKER: *n = 1; return one8;
    default: *n = 0; return NULL;
    }
}

/* a record's ticks of another timestamp source as CLOCK_REALTIME ns (0 where unmapped);
 * 1 when some were unmapped */
static inline int clock_fix(uint8_t *rec, int kind, size_t sz, const rl_clock_map_t *m) {
    int n, unmapped = 0, mapped = 0;
    const uint8_t *offs = ts_offsets(kind, &n);
    for (int i = 0; i < n; i++) {
        if ((size_t)offs[i] + 8 > sz) continue;
        uint64_t v;
        memcpy(&v, rec + offs[i], 8);
        if (v == 0 || v >= RL_NS_FLOOR) continue;
        if (m->valid) {
            v = rl_clock_map(m, v);
            mapped = 1;
        } else {
            v = 0;
            unmapped = 1;
        }
        memcpy(rec + offs[i], &v, 8);
    }
    if (unmapped) atomic_fetch_add(&g_clock_unmapped, 1);
    else if (mapped) atomic_fetch_add(&g_clock_mapped, 1);
    return unmapped;
}

/* 1 when the record is of a kind (and API call) Ridgeline enabled, not only the guest */
static inline int record_ours(const uint8_t *p, int kind, size_t sz) {
    if (!atomic_load(&g_guest_seen)) return 1;
    if (kind == CUPTI_ACTIVITY_KIND_RUNTIME || kind == CUPTI_ACTIVITY_KIND_DRIVER) {
        uint32_t cbid;
        if (sz < 8) return 0;
        memcpy(&cbid, p + 4, 4);
        return cbid < 4096 && g_our_cbid[kind == CUPTI_ACTIVITY_KIND_DRIVER][cbid];
    }
    return kind > 0 && kind < RL_KIND_MAX && atomic_load(&g_our_kind[kind]);
}


#pragma GCC visibility pop

#endif

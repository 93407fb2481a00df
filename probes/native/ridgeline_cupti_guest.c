/* Part of libridgeline_cupti.so (see ridgeline_cupti.c): CUPTI timestamps that
 * another client's timestamp source turned into ticks, and sharing a legacy CUPTI with a
 * later client (torch.profiler / Kineto) exactly, when `ridgeline run` preloads this
 * library (LD_PRELOAD) so that libtorch's calls into libcupti reach the entry points
 * below first.
 *
 * Kineto's real sequence (pytorch/kineto libkineto/src, cited in
 * tests/test_native_cupti_share.py, replayed by probes/native/tests/kineto_replay.c):
 *   configure: CuptiActivityProfiler.cpp:120-123 cuptiActivityRegisterTimestampCallback
 *     (getApproximateTime = __rdtsc, ApproximateClock.h:77-79, on by default,
 *     Config.h:527), then CuptiActivityApi.cpp:318 cuptiActivityRegisterCallbacks and
 *     :324-361 cuptiActivityEnable of its kinds;
 *   stop: CuptiActivityApi.cpp:371-398 cuptiActivityDisable of the same kinds;
 *   process: CuptiActivityApi.cpp:166-181 activityBuffers returns nothing at all unless
 *     one of its buffers is outstanding, else cuptiActivityFlushAll(FORCED);
 *   its bufferCompleted drops any buffer it did not allocate (CuptiActivityApi.cpp:266-272).
 * What the entry points do instead of letting the callbacks be replaced: CUPTI keeps
 * calling Ridgeline's callbacks; the other client gets, in buffers it allocated itself
 * (one always outstanding while its session is open, so its activityBuffers flushes),
 * a copy of every record of the kinds it enabled; Ridgeline keeps its own kinds on when
 * the client disables them. Records outside the client's capture window are dropped by
 * Kineto itself (GenericActivityProfiler.cpp:413 outOfRange). */

#include "ridgeline_cupti_internal.h"

#include <link.h>
#include <sys/stat.h>

/* ---- timestamps ----------------------------------------------------------------------- */

/* Field offsets of the timestamps of each record kind Ridgeline ships (the same in every
 * layout of CUDA 12.4 .. 13.5; checked against the header built with). */
_Static_assert(offsetof(RL_HDR_KERNEL_T, start) == 16 && offsetof(RL_HDR_KERNEL_T, end) == 24 &&
                   offsetof(RL_HDR_KERNEL_T, completed) == 32 && offsetof(RL_HDR_KERNEL_T, queued) == 120 &&
                   offsetof(RL_HDR_KERNEL_T, submitted) == 128,
               "kernel timestamp offsets");
_Static_assert(offsetof(RL_HDR_MEMCPY_T, start) == 16 && offsetof(RL_HDR_MEMCPY_T, end) == 24, "memcpy timestamps");
_Static_assert(offsetof(RL_HDR_MEMSET_T, start) == 16 && offsetof(RL_HDR_MEMSET_T, end) == 24, "memset timestamps");
_Static_assert(offsetof(CUpti_ActivityAPI, start) == 8 && offsetof(CUpti_ActivityAPI, end) == 16, "API timestamps");
_Static_assert(offsetof(CUpti_ActivityMarker2, timestamp) == 8, "marker timestamp");
_Static_assert(offsetof(CUpti_ActivityGraphTrace2, start) == 8 && offsetof(CUpti_ActivityGraphTrace2, end) == 16,
               "graph trace timestamps");


static pthread_mutex_t g_clock_lock = PTHREAD_MUTEX_INITIALIZER;
static rl_clock_map_t g_clock_map;           /* under g_clock_lock */
static uint64_t (*_Atomic g_ts_cb)(void);    /* a source registered through our entry point */
atomic_uint_fast64_t g_clock_mapped, g_clock_unmapped, g_clock_pairs;

static int64_t rt_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* CUPTI's current timestamp: the registered source itself when we saw it registered (the
 * very function CUPTI calls), else cuptiGetTimestamp ("normalized to correspond with the
 * start and end timestamps reported in the CUPTI activity records", cupti_activity.h). */
static int src_now(uint64_t *t) {
    uint64_t (*cb)(void) = atomic_load(&g_ts_cb);
    if (cb) {
        *t = cb();
        return 0;
    }
    return C.GetTimestamp && C.GetTimestamp(t) == CUPTI_SUCCESS ? 0 : -1;
}

/* One (source, CLOCK_REALTIME) pair, the realtime read on both sides (midpoint). The
 * tightest of up to 8 tries is kept (done at once below 2 us): a try that was preempted
 * between its reads puts up to half its spread into the pair, and over the first 2 ms
 * scale a 100 us spread alone is a 5% error in every duration. None within 100 us: no pair. */
static int clock_pair(uint64_t *t, int64_t *rt) {
    int64_t best = INT64_MAX;
    for (int attempt = 0; attempt < 8 && best > 2000; attempt++) {
        uint64_t ti;
        int64_t a = rt_now_ns();
        if (src_now(&ti)) return -1;
        int64_t b = rt_now_ns();
        if (b - a < best) {
            best = b - a;
            *t = ti;
            *rt = a + (b - a) / 2;
        }
    }
    if (best > 100000) return -1;
    atomic_fetch_add(&g_clock_pairs, 1);
    return 0;
}

/* Two pairs RL_CLOCK_CALIBRATE_NS apart: a first scale as soon as ticks appear; the
 * sender then refines it every flush period over the whole time since (clock_tick). */
#define RL_CLOCK_CALIBRATE_NS 2000000LL
static int clock_calibrate(rl_clock_map_t *m) {
    uint64_t t0, t1;
    int64_t r0, r1;
    if (clock_pair(&t0, &r0)) return -1;
    do {
        if (clock_pair(&t1, &r1)) return -1;
    } while (r1 - r0 < RL_CLOCK_CALIBRATE_NS);
    if (t1 <= t0 || t1 >= RL_NS_FLOOR) return -1;
    m->base_tick = t0;
    m->base_rt = r0;
    m->anchor_tick = t1;
    m->anchor_rt = r1;
    m->ns_per_tick = (double)(r1 - r0) / (double)(t1 - t0);
    m->valid = 1;
    return 0;
}

/* Converts one record's timestamps in place (our copy, never CUPTI's buffer): a value
 * below RL_NS_FLOOR is a tick of the registered source and becomes CLOCK_REALTIME ns
 * through the map; without a map it becomes 0, which the agent rejects and counts
 * (rejected_timestamps): a tick is never published as nanoseconds. Returns 1 if any field
 * of the record could not be mapped. */

void clock_snapshot(rl_clock_map_t *out) {
    pthread_mutex_lock(&g_clock_lock);
    *out = g_clock_map;
    pthread_mutex_unlock(&g_clock_lock);
}

atomic_int g_guest_seen;

/* Sender thread, every flush period: a (source, CLOCK_REALTIME) pair. Ticks (a value
 * below RL_NS_FLOOR): the map is made (first time) or refined (anchor = this pair, scale
 * over the whole time since the first pair). A source that moved but still reads as
 * CLOCK_REALTIME ns is reported as before. */
static int64_t g_clock_offset_ns;
static int g_clock_known;

void clock_tick(void) {
    uint64_t t;
    int64_t rt;
    if (clock_pair(&t, &rt)) return;
    if (t < RL_NS_FLOOR) {
        pthread_mutex_lock(&g_clock_lock);
        int fresh = !g_clock_map.valid;
        if (fresh) {
            rl_clock_map_t m = {0};
            if (clock_calibrate(&m) == 0) g_clock_map = m;
        } else if (t > g_clock_map.base_tick && rt - g_clock_map.base_rt >= 100000000LL) {
            g_clock_map.ns_per_tick = (double)(rt - g_clock_map.base_rt) / (double)(t - g_clock_map.base_tick);
            g_clock_map.anchor_tick = t;
            g_clock_map.anchor_rt = rt;
        }
        rl_clock_map_t m = g_clock_map;
        pthread_mutex_unlock(&g_clock_lock);
        if (fresh && m.valid) {
            rl_log("clock: CUPTI timestamps are now ticks of another client's timestamp source (%.6f ns per tick; "
                   "Kineto registers __rdtsc); Ridgeline maps them to CLOCK_REALTIME from (CUPTI timestamp, "
                   "CLOCK_REALTIME) pairs taken every flush period",
                   m.ns_per_tick);
            /* Kineto registers its source right before its buffer callbacks
             * (CuptiActivityProfiler.cpp:120-127): on a legacy CUPTI, unless this library
             * was preloaded and shares CUPTI with it, that is the takeover. */
            if (!g_multi && !atomic_load(&g_guest_seen) && !atomic_load(&g_taken_over))
                takeover_detected(cbufs_all_lost(), "CUPTI's timestamp source was replaced by another client's, which Kineto does "
                                     "right before it registers its buffer callbacks");
        }
        return;
    }
    int64_t off = (int64_t)t - rt;
    if (!g_clock_known) {
        g_clock_known = 1;
        g_clock_offset_ns = off;
    } else if (llabs(off - g_clock_offset_ns) > RL_CLOCK_JUMP_NS) {
        rl_log("clock: CUPTI timestamps moved by %lld ns against CLOCK_REALTIME (now %+lld ns from it): "
               "another tool registered its own timestamp source", (long long)(off - g_clock_offset_ns),
               (long long)off);
        g_clock_offset_ns = off;
    }
}

/* ---- records that are not Ridgeline's ---------------------------------------------------- */

/* While another client shares CUPTI, the buffers also hold the kinds it enabled (whole
 * RUNTIME/DRIVER, SYNCHRONIZATION, ...): Ridgeline keeps only its own kinds and cbids. */
/* g_our_kind (declared in ridgeline_cupti.c): set by apply_mode */
uint8_t g_our_cbid[2][4096]; /* [driver?][cbid] */

static void note_our_kinds(void) {
    for (size_t i = 0; i < N_CBIDS; i++)
        if (CBIDS[i].cbid < 4096) g_our_cbid[CBIDS[i].domain == RL_DOMAIN_DRIVER][CBIDS[i].cbid] = 1;
}


/* ---- the other client (guest) ---------------------------------------------------------- */

static pthread_mutex_t g_guest_lock = PTHREAD_MUTEX_INITIALIZER;
static CUpti_BuffersCallbackRequestFunc g_guest_req;
static CUpti_BuffersCallbackCompleteFunc g_guest_comp;
static int g_guest_open;      /* from its callbacks' registration to its forced flush after its stop */
static int g_guest_stopping;  /* it disabled CONCURRENT_KERNEL: its next forced flush closes the session */
static uint64_t g_guest_kinds; /* kinds it enabled (bit per kind) */
static uint8_t *g_stage;      /* its buffer we fill with copies; one outstanding while open */
static size_t g_stage_size, g_stage_used;
atomic_uint_fast64_t g_guest_records, g_guest_buffers, g_guest_sessions, g_guest_dropped;
static __thread int t_forwarding;

/* Caller holds g_guest_lock. Hands the staging buffer to the client (its bufferCompleted
 * finds it in its own map) and, while the session stays open, asks it for the next. */
static void stage_complete(int renew) {
    if (g_stage && g_guest_comp) {
        g_guest_comp(NULL, 0, g_stage, g_stage_size, g_stage_used);
        atomic_fetch_add(&g_guest_buffers, 1);
    }
    g_stage = NULL;
    g_stage_size = g_stage_used = 0;
    if (renew && g_guest_req) {
        uint8_t *b = NULL;
        size_t size = 0, maxrec = 0;
        g_guest_req(&b, &size, &maxrec);
        if (b && size >= 8) {
            g_stage = b;
            g_stage_size = size;
        }
    }
}

/* Our completion callback, after our own copy: the client's kinds go to it. */
void guest_tee(uint8_t *buf, size_t valid) {
    if (!atomic_load(&g_guest_seen)) return;
    pthread_mutex_lock(&g_guest_lock);
    if (!g_guest_open) {
        pthread_mutex_unlock(&g_guest_lock);
        return;
    }
    uint8_t *p = buf;
    size_t sz;
    uint64_t n = 0, dropped = 0;
    while ((size_t)(p - buf) < valid && (sz = record_size(buf, valid, p)) != 0) {
        int32_t kind;
        memcpy(&kind, p, 4);
        if (kind > 0 && kind < 64 && (g_guest_kinds >> kind & 1)) {
            if (g_stage && g_stage_used + sz > g_stage_size) stage_complete(1);
            if (!g_stage) stage_complete(1);
            if (g_stage && g_stage_used + sz <= g_stage_size) {
                memcpy(g_stage + g_stage_used, p, sz);
                g_stage_used += sz;
                n++;
            } else {
                dropped++;   /* it refused a buffer (its own cap): CUPTI would have dropped it too */
            }
        }
        p += sz;
    }
    pthread_mutex_unlock(&g_guest_lock);
    if (n) atomic_fetch_add(&g_guest_records, n);
    if (dropped) atomic_fetch_add(&g_guest_dropped, dropped);
}

/* A buffer that is not ours reached our completion callback: the client's own, handed to
 * CUPTI before we registered (it registered first). Its records were read; it goes to its
 * owner. Returns 1 if it did. */
int guest_own_buffer(uint8_t *buf, size_t size, size_t valid) {
    pthread_mutex_lock(&g_guest_lock);
    CUpti_BuffersCallbackCompleteFunc comp = g_guest_comp;
    if (comp) comp(NULL, 0, buf, size, valid);
    pthread_mutex_unlock(&g_guest_lock);
    return comp != NULL;
}

static int sharing(void) {
    return !t_forwarding && atomic_load(&g_active) && C.lib && !g_multi && !g_test_mode &&
           !(atomic_load(&g_flags) & (RL_FLAG_CONFLICT | RL_FLAG_NO_CUPTI));
}

/* A libcupti some other object loaded, found by its file name among the loaded objects:
 * a tool that owns CUDA injection (CUDA_INJECTION64_PATH names its library, not ours)
 * loads its libcupti with dlopen(RTLD_LOCAL), which puts it outside the global scope
 * that RTLD_NEXT searches, while its calls still bind to our preloaded entry points
 * first (the global scope comes before a dlopen'ed object's own). Not finding it
 * returned CUPTI_ERROR_NOT_INITIALIZED to that tool: our preload broke it. */
static int find_cupti_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    const char *n = info->dlpi_name;
    if (!n || !*n) return 0;
    const char *b = strrchr(n, '/');
    b = b ? b + 1 : n;
    if (strncmp(b, "libcupti", 8)) return 0;
    snprintf((char *)data, PATH_MAX, "%s", n);
    return 1;
}

static void *loaded_cupti(void) {
    static void *_Atomic handle;
    void *h = atomic_load(&handle);
    if (h) return h;
    char path[PATH_MAX] = {0};
    if (!dl_iterate_phdr(find_cupti_cb, path)) return NULL;
    h = dlopen(path, RTLD_NOW | RTLD_NOLOAD); /* a reference to the loaded one, never a load */
    if (h) atomic_store(&handle, h);
    return h;
}

/* 1 when the injection variable `var` names another file than this library. For
 * CUDA_INJECTION64_PATH the driver then initialises that tool, never us, so here we only
 * pass CUPTI calls through; for NVTX_INJECTION64_PATH the ranges go to that tool. */
int foreign_injection(const char *var, const char **owner) {
    const char *p = getenv(var);
    *owner = p;
    if (!p || !*p || !strcmp(p, "none")) return 0;
    Dl_info info;
    struct stat a, b;
    if (!dladdr((void *)&foreign_injection, &info) || !info.dli_fname) return 0;
    if (stat(p, &a) || stat(info.dli_fname, &b)) return strcmp(p, info.dli_fname) != 0;
    return a.st_dev != b.st_dev || a.st_ino != b.st_ino;
}

static atomic_int g_foreign_noted;

/* Said once, on the first CUPTI call that reaches us without Ridgeline collecting. */
static void note_foreign_owner(void) {
    const char *owner;
    if (atomic_load(&g_initialized) || atomic_exchange(&g_foreign_noted, 1) || !foreign_injection("CUDA_INJECTION64_PATH", &owner)) return;
    rl_log("another tool owns CUDA injection (CUDA_INJECTION64_PATH=%s): Ridgeline collects nothing in this "
           "process and passes its CUPTI calls through unchanged", owner);
}

/* The real entry point: the libcupti we loaded, else the next object (the client's),
 * else a libcupti loaded out of the global scope (the owner's, see loaded_cupti). */
static void *real_fn(void *ours, const char *name) {
    if (ours) return ours;
    note_foreign_owner();
    void *f = dlsym(RTLD_NEXT, name);
    if (f) return f;
    void *h = loaded_cupti();
    return h ? dlsym(h, name) : NULL;
}
#define REAL(field, name, type) ((type)real_fn((void *)C.field, name))

/* At InitializeInjection, after our callbacks are registered: a client that registered
 * before us (its calls passed through) and is collecting becomes a shared session. */
void guest_adopt(void) {
    note_our_kinds();
    pthread_mutex_lock(&g_guest_lock);
    if (g_guest_comp && (g_guest_kinds >> CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL & 1) && !g_guest_open) {
        g_guest_open = 1;
        atomic_store(&g_guest_seen, 1);
        stage_complete(1);
    }
    pthread_mutex_unlock(&g_guest_lock);
}

RL_EXPORT CUptiResult CUPTIAPI cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc req,
                                                              CUpti_BuffersCallbackCompleteFunc comp) {
    if (!sharing()) {
        pthread_mutex_lock(&g_guest_lock);
        g_guest_req = req;
        g_guest_comp = comp;
        pthread_mutex_unlock(&g_guest_lock);
        fn_RegisterCallbacks f = REAL(RegisterCallbacks, "cuptiActivityRegisterCallbacks", fn_RegisterCallbacks);
        t_forwarding++;
        CUptiResult r = f ? f(req, comp) : CUPTI_ERROR_NOT_INITIALIZED;
        t_forwarding--;
        return r;
    }
    if (!req || !comp) return CUPTI_ERROR_INVALID_PARAMETER;
    /* What the issue asks for first: nothing of ours that is complete stays inside CUPTI
     * when the session opens (a buffer held by a record in flight completes to us later,
     * and its records of the client's kinds go to the client). */
    (void)C.FlushAll(0);
    pthread_mutex_lock(&g_guest_lock);
    if (g_guest_open) stage_complete(0); /* a new session replaces an unfinished one */
    g_guest_req = req;
    g_guest_comp = comp;
    g_guest_open = 1;
    g_guest_stopping = 0;
    g_guest_kinds = 0;
    atomic_store(&g_guest_seen, 1);
    /* one of its buffers outstanding from the start: its activityBuffers returns nothing
     * when none is (CuptiActivityApi.cpp:166-171) */
    stage_complete(1);
    pthread_mutex_unlock(&g_guest_lock);
    atomic_fetch_add(&g_guest_sessions, 1);
    rl_log("shared: another CUPTI client (torch.profiler?) registered its activity buffer callbacks; CUPTI keeps "
           "Ridgeline's, and that client gets a copy of every record of the kinds it enables, in its own buffers");
    return CUPTI_SUCCESS;
}

RL_EXPORT CUptiResult CUPTIAPI cuptiActivityEnable(CUpti_ActivityKind kind) {
    fn_Kind f = REAL(Enable, "cuptiActivityEnable", fn_Kind);
    if ((int)kind > 0 && (int)kind < 64 && !t_forwarding) {
        pthread_mutex_lock(&g_guest_lock);
        g_guest_kinds |= 1ull << (int)kind;
        pthread_mutex_unlock(&g_guest_lock);
    }
    t_forwarding++;
    CUptiResult r = f ? f(kind) : CUPTI_ERROR_NOT_INITIALIZED;
    t_forwarding--;
    return r;
}

RL_EXPORT CUptiResult CUPTIAPI cuptiActivityDisable(CUpti_ActivityKind kind) {
    fn_Kind f = REAL(Disable, "cuptiActivityDisable", fn_Kind);
    int share = sharing();
    if (share && (int)kind > 0 && (int)kind < RL_KIND_MAX) {
        if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            pthread_mutex_lock(&g_guest_lock);
            g_guest_stopping = 1;
            pthread_mutex_unlock(&g_guest_lock);
        }
        /* The kinds are process-global: disabling one of ours would stop Ridgeline's
         * collection too. The client gets no more of them anyway once its session closes. */
        if (atomic_load(&g_our_kind[kind])) return CUPTI_SUCCESS;
    }
    t_forwarding++;
    CUptiResult r = f ? f(kind) : CUPTI_ERROR_NOT_INITIALIZED;
    t_forwarding--;
    if (share && (kind == CUPTI_ACTIVITY_KIND_RUNTIME || kind == CUPTI_ACTIVITY_KIND_DRIVER)) {
        /* the whole kind went off: our launch/sync cbids back on */
        for (size_t i = 0; i < N_CBIDS; i++)
            if (!CBIDS[i].deep_only && (CBIDS[i].domain == RL_DOMAIN_DRIVER) == (kind == CUPTI_ACTIVITY_KIND_DRIVER)) {
                t_forwarding++;
                (void)api_set(&CBIDS[i], 1);
                t_forwarding--;
            }
    }
    return r;
}

RL_EXPORT CUptiResult CUPTIAPI cuptiActivityFlushAll(uint32_t flag) {
    fn_FlushAll f = REAL(FlushAll, "cuptiActivityFlushAll", fn_FlushAll);
    int share = sharing();
    t_forwarding++;
    CUptiResult r = f ? f(flag) : CUPTI_ERROR_NOT_INITIALIZED;
    t_forwarding--;
    if (share && (flag & CUPTI_ACTIVITY_FLAG_FLUSH_FORCED)) {
        /* Its activityBuffers (CuptiActivityApi.cpp:181): everything CUPTI held came back
         * to our callback during the flush and its share is in the staging buffer; it
         * must be in the client's hands before the flush returns. */
        int closed = 0;
        pthread_mutex_lock(&g_guest_lock);
        if (g_guest_open) {
            closed = g_guest_stopping;
            stage_complete(!closed);
            if (closed) g_guest_open = 0;
        }
        pthread_mutex_unlock(&g_guest_lock);
        if (closed)
            rl_log("shared: the other CUPTI client stopped and took its records (%llu records in %llu buffers so far)",
                   (unsigned long long)atomic_load(&g_guest_records), (unsigned long long)atomic_load(&g_guest_buffers));
    }
    return r;
}

RL_EXPORT CUptiResult CUPTIAPI cuptiActivityRegisterTimestampCallback(CUpti_TimestampCallbackFunc cb) {
    typedef CUptiResult (*fn_ts)(CUpti_TimestampCallbackFunc);
    fn_ts f = (fn_ts)real_fn(C.lib ? dlsym(C.lib, "cuptiActivityRegisterTimestampCallback") : NULL,
                             "cuptiActivityRegisterTimestampCallback");
    t_forwarding++;
    CUptiResult r = f ? f(cb) : CUPTI_ERROR_NOT_INITIALIZED;
    t_forwarding--;
    if (r != CUPTI_SUCCESS || !cb) return r;
    /* Exactly now, on the client's thread and before it enables a kind: the map exists
     * before the first record stamped by its source can reach our callback. */
    atomic_store(&g_ts_cb, (uint64_t(*)(void))cb);
    rl_clock_map_t m = {0};
    if (cb() < RL_NS_FLOOR && clock_calibrate(&m) == 0) {
        pthread_mutex_lock(&g_clock_lock);
        g_clock_map = m;
        pthread_mutex_unlock(&g_clock_lock);
        rl_log("clock: another CUPTI client registered its timestamp source (ticks, %.6f ns per tick); Ridgeline "
               "maps CUPTI timestamps to CLOCK_REALTIME from (source, CLOCK_REALTIME) pairs taken every flush period",
               m.ns_per_tick);
    }
    return r;
}

RL_EXPORT CUptiResult CUPTIAPI cuptiFinalize(void) {
    typedef CUptiResult (*fn_fin)(void);
    fn_fin f = (fn_fin)real_fn(C.lib ? dlsym(C.lib, "cuptiFinalize") : NULL, "cuptiFinalize");
    int share = sharing();
    t_forwarding++;
    CUptiResult r = f ? f() : CUPTI_ERROR_NOT_INITIALIZED;
    t_forwarding--;
    /* CUPTI forgot every callback, kind and the timestamp source: ticks no more. */
    atomic_store(&g_ts_cb, NULL);
    pthread_mutex_lock(&g_clock_lock);
    memset(&g_clock_map, 0, sizeof g_clock_map);
    pthread_mutex_unlock(&g_clock_lock);
    pthread_mutex_lock(&g_guest_lock);
    g_guest_open = 0;
    g_stage = NULL;
    g_guest_req = NULL;
    g_guest_comp = NULL;
    pthread_mutex_unlock(&g_guest_lock);
    if (share && r == CUPTI_SUCCESS) atomic_store(&g_cupti_finalized, 1); /* the sender registers again */
    return r;
}

/* A stand-in libcupti for tests without a GPU (tests/test_native_cupti_stub.py).
 *
 * It exports the CUPTI entry points libridgeline_cupti.so resolves, records every call
 * in a log, and behaves as the environment says:
 *   STUB_CUPTI_VERSION=N            cuptiGetVersion result (default: the header's)
 *   STUB_CUPTI_OTHER_SUBSCRIBER=s   another tool holds CUPTI: subscribe fails with
 *                                   CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED naming s
 *   STUB_CUPTI_MULTI=1              multi-subscriber mode is available (CUDA >= 13.2, r610+)
 *   STUB_CUPTI_MULTI_STATE=N|fail   what CUPTI_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE reads
 *                                   (default 1; "fail": the attribute cannot be read)
 *   STUB_CUPTI_CONFLICT_KINDS=a,b   enabling these activity kinds fails (another user)
 *   STUB_CUPTI_DROPPED=N            records CUPTI reports dropped, once (v1 and v2 calls)
 *   STUB_CUPTI_NO_STRUCT_SIZE=1     no cuptiActivityGetStructSize (CUPTI < 13.2): the
 *                                   library walks buffers with cuptiActivityGetNextRecord
 *   STUB_CUPTI_ENABLED_KINDS=1      cuptiActivityGetEnabledKinds answers (CUPTI >= 13.2)
 *   STUB_CUPTI_KERNEL_SIZE=N        kernel records are N bytes (a layout unknown to the library)
 *   STUB_CUPTI_FINI_MS=N            at process exit, libcupti's static destructors take N ms
 *                                   (the real libcupti.so.12/13 have C++ destructors and a
 *                                   FINI_ARRAY); a call into CUPTI during or after them is
 *                                   what would crash a real one: the stub writes
 *                                   "stub: CUPTI called after its destructors" and _exit(97)s
 *   STUB_CUPTI_EXIT_FLUSH=1         at exit, after the library's own atexit handler, CUPTI
 *                                   delivers one more buffer (context teardown flushes the
 *                                   records of the last kernels): a copy of the last record
 * stub_deliver() plays CUPTI delivering a completed buffer: it asks the registered
 * request callback for a buffer, copies the records in, and calls the completion callback.
 * stub_record() plays CUPTI writing records as kernels complete: they go into the current
 * buffer, which is completed only when full or on cuptiActivityFlushAll, as CUPTI does.
 * stub_kineto_start()/stub_kineto_stop() play torch.profiler (Kineto's CuptiActivityApi)
 * taking CUPTI over on a legacy single-subscriber CUPTI, call for call.
 */
#define _GNU_SOURCE
/* The stub defines the _v2 entry points with the local types of ridgeline_cupti_abi.h, so
 * it builds with any header set: the headers' own declarations are renamed away. */
#define cuptiSubscribe_v2 hdr_cuptiSubscribe_v2
#define cuptiActivityRegisterCallbacks_v2 hdr_cuptiActivityRegisterCallbacks_v2
#define cuptiActivityEnable_v2 hdr_cuptiActivityEnable_v2
#define cuptiActivityDisable_v2 hdr_cuptiActivityDisable_v2
#define cuptiActivityRegisterTimestampCallback hdr_cuptiActivityRegisterTimestampCallback
#include <cuda.h>
#include <cupti_result.h>
#include <cupti_version.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include "ridgeline_cupti_abi.h"
#undef cuptiSubscribe_v2
#undef cuptiActivityRegisterCallbacks_v2
#undef cuptiActivityEnable_v2
#undef cuptiActivityDisable_v2
#undef cuptiActivityRegisterTimestampCallback

#include <sys/mman.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>
#include <x86intrin.h>

#define EXPORT __attribute__((visibility("default")))

/* this stub plays the CUPTI release of the header it is built with */
#if CUPTI_API_VERSION >= 130401
#define STUB_KERNEL_SIZE sizeof(CUpti_ActivityKernel13)
#define STUB_MEMCPY_SIZE sizeof(CUpti_ActivityMemcpy7)
#define STUB_MEMSET_SIZE sizeof(CUpti_ActivityMemset5)
#else
#define STUB_KERNEL_SIZE sizeof(CUpti_ActivityKernel9)
#define STUB_MEMCPY_SIZE sizeof(CUpti_ActivityMemcpy5)
#define STUB_MEMSET_SIZE sizeof(CUpti_ActivityMemset4)
#endif

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[1 << 16];
static CUpti_BuffersCallbackRequestFunc req1;
static CUpti_BuffersCallbackCompleteFunc comp1;
static rl_buffer_request2_fn req2;
static rl_buffer_complete2_fn comp2;
static int dropped_reported;
static pthread_mutex_t buf_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *cur_buf;               /* the buffer CUPTI is filling (stub_record) */
static size_t cur_size, cur_used;
static void *cur_owner;                /* the request callback that handed it out */
static int enabled[64];                /* activity kinds enabled (process-wide, v1) */
static int kineto_leaked;              /* buffers Kineto got but did not allocate */
static uint64_t (*ts_cb)(void);        /* a registered timestamp source */

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logf_(const char *fmt, ...) {
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&lock);
    size_t u = strlen(log_buf);
    snprintf(log_buf + u, sizeof log_buf - u, "%s\n", line);
    pthread_mutex_unlock(&lock);
}

/* Process exit: libcupti's destructors run (see STUB_CUPTI_FINI_MS). */
static volatile int destroyed;

__attribute__((destructor)) static void stub_fini(void) {
    const char *ms = getenv("STUB_CUPTI_FINI_MS");
    if (!ms || !*ms) return;
    destroyed = 1;
    usleep((useconds_t)atoi(ms) * 1000u);
}

static void check_alive(const char *fn) {
    if (!destroyed) return;
    char line[128];
    int n = snprintf(line, sizeof line, "stub: CUPTI called after its destructors (%s)\n", fn);
    if (n > 0) {
        ssize_t w = write(2, line, (size_t)n);
        (void)w;
    }
    _exit(97);
}

static int in_list(const char *env, int v) {
    const char *s = getenv(env);
    if (!s) return 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ","))
        if (atoi(t) == v) return 1;
    return 0;
}

EXPORT CUptiResult cuptiGetVersion(uint32_t *v) {
    const char *s = getenv("STUB_CUPTI_VERSION");
    *v = s ? (uint32_t)atoi(s) : CUPTI_API_VERSION;
    logf_("version");
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiGetResultString(CUptiResult r, const char **s) {
    *s = r == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED ? "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"
                                                             : "CUPTI_ERROR_STUB";
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiSubscribe(CUpti_SubscriberHandle *h, CUpti_CallbackFunc cb, void *ud) {
    logf_("subscribe");
    if (getenv("STUB_CUPTI_OTHER_SUBSCRIBER")) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    *h = (CUpti_SubscriberHandle)(uintptr_t)1;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiSubscribe_v2(CUpti_SubscriberHandle *h, CUpti_CallbackFunc cb, void *ud,
                                     rl_subscriber_params_t *p) {
    logf_("subscribe_v2 allow=%d name=%s", p ? p->allowMultipleSubscribers : -1,
          p && p->subscriberName ? p->subscriberName : "");
    const char *other = getenv("STUB_CUPTI_OTHER_SUBSCRIBER");
    int multi = getenv("STUB_CUPTI_MULTI") != NULL;
    if (other && !(multi && p && p->allowMultipleSubscribers)) {
        if (p && p->oldSubscriberName) snprintf(p->oldSubscriberName, p->oldSubscriberSize, "%s", other);
        return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    }
    if (p && p->allowMultipleSubscribers && !multi) return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    *h = (CUpti_SubscriberHandle)(uintptr_t)2;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiUnsubscribe(CUpti_SubscriberHandle h) {
    logf_("unsubscribe");
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiFinalize(void) {
    logf_("finalize");
    /* CUPTI unloads: callbacks and enabled kinds are gone (the buffer in use too) */
    pthread_mutex_lock(&buf_lock);
    req1 = NULL;
    comp1 = NULL;
    cur_buf = NULL;
    ts_cb = NULL;
    memset(enabled, 0, sizeof enabled);
    pthread_mutex_unlock(&buf_lock);
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc r,
                                                  CUpti_BuffersCallbackCompleteFunc c) {
    logf_("register");
    req1 = r;
    comp1 = c;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityRegisterCallbacks_v2(CUpti_SubscriberHandle s, rl_buffer_request2_fn r,
                                                     rl_buffer_complete2_fn c) {
    logf_("register2");
    req2 = r;
    comp2 = c;
    return CUPTI_SUCCESS;
}

static CUptiResult enable_common(const char *what, CUpti_ActivityKind k) {
    logf_("%s %d", what, (int)k);
    if ((int)k >= 0 && (int)k < 64 && (!strcmp(what, "enable") || !strcmp(what, "disable")))
        enabled[(int)k] = !strcmp(what, "enable");
    if (!strncmp(what, "enable", 6) && in_list("STUB_CUPTI_CONFLICT_KINDS", (int)k))
        return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityEnable(CUpti_ActivityKind k) { return enable_common("enable", k); }
EXPORT CUptiResult cuptiActivityDisable(CUpti_ActivityKind k) { return enable_common("disable", k); }
EXPORT CUptiResult cuptiActivityEnable_v2(CUpti_SubscriberHandle s, CUpti_ActivityKind k, void *c) {
    return enable_common("enable2", k);
}
EXPORT CUptiResult cuptiActivityDisable_v2(CUpti_SubscriberHandle s, CUpti_ActivityKind k, void *c) {
    return enable_common("disable2", k);
}
EXPORT CUptiResult cuptiActivityEnableRuntimeApi(CUpti_CallbackId cbid, uint8_t en) {
    logf_("rt %u %u", cbid, en);
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityEnableDriverApi(CUpti_CallbackId cbid, uint8_t en) {
    logf_("drv %u %u", cbid, en);
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityEnableRuntimeApi_v2(CUpti_SubscriberHandle s, CUpti_CallbackId cbid, uint8_t en) {
    logf_("rt2 %u %u", cbid, en);
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityEnableDriverApi_v2(CUpti_SubscriberHandle s, CUpti_CallbackId cbid, uint8_t en) {
    logf_("drv2 %u %u", cbid, en);
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityEnableLatencyTimestamps(uint8_t en) {
    logf_("latency %u", en);
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityFlushPeriod(uint32_t ms) {
    logf_("flushperiod %u", ms);
    return CUPTI_SUCCESS;
}
static void complete_current(void);
static int held; /* the current buffer holds an incomplete record (a long-running kernel) */

EXPORT void stub_hold(int on) {
    held = on;
    if (!on) complete_current(); /* the kernel finished; CUPTI's worker returns the buffer */
}

EXPORT CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    check_alive("cuptiActivityFlushAll");
    logf_("flushall %u tid=%ld", flag, (long)gettid());
    /* as documented: an error until someone registered buffer callbacks (after cuptiFinalize too) */
    if (!req1 && !req2) return CUPTI_ERROR_INVALID_OPERATION;
    /* every record the stub writes is complete (flag 0 returns the partial buffer too),
     * unless stub_hold() plays a record still in flight: then only a forced flush does */
    if (!held || flag == CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) complete_current();
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityGetNumDroppedRecords_v2(CUpti_SubscriberHandle h, CUcontext c, uint32_t s, size_t *n) {
    const char *d = getenv("STUB_CUPTI_DROPPED");
    *n = (d && !dropped_reported) ? (size_t)atol(d) : 0;
    dropped_reported = 1;
    logf_("dropped2");
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext c, uint32_t s, size_t *n) {
    const char *d = getenv("STUB_CUPTI_DROPPED");
    *n = (d && !dropped_reported) ? (size_t)atol(d) : 0;
    dropped_reported = 1;
    return CUPTI_SUCCESS;
}
/* Record sizes of this stub's CUPTI release: the header it is built with. */
static size_t stub_size(int kind) {
    switch (kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const char *k = getenv("STUB_CUPTI_KERNEL_SIZE"); /* a release with a kernel layout we do not know */
        return k ? (size_t)atol(k) : STUB_KERNEL_SIZE;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: return STUB_MEMCPY_SIZE;
    case CUPTI_ACTIVITY_KIND_MEMSET: return STUB_MEMSET_SIZE;
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API: return sizeof(CUpti_ActivityAPI);
    case CUPTI_ACTIVITY_KIND_MARKER: return sizeof(CUpti_ActivityMarker2);
    case CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION: return sizeof(CUpti_ActivityExternalCorrelation);
    case CUPTI_ACTIVITY_KIND_GRAPH_TRACE: return sizeof(CUpti_ActivityGraphTrace2);
    default: return 0;
    }
}

/* CUPTI's walker: the first record for *r == NULL, else the one after *r. */
EXPORT CUptiResult cuptiActivityGetNextRecord(uint8_t *b, size_t v, CUpti_Activity **r) {
    uint8_t *p = *r ? (uint8_t *)*r : b;
    if (*r) {
        int32_t kind;
        memcpy(&kind, p, 4);
        size_t sz = stub_size(kind);
        if (!sz) return CUPTI_ERROR_INVALID_KIND;
        p += sz;
    }
    if ((size_t)(p - b) >= v) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    *r = (CUpti_Activity *)p;
    return CUPTI_SUCCESS;
}

/* CUPTI >= 13.2: the kinds enabled by anyone (subscriber NULL). STUB_CUPTI_ENABLED_KINDS=1
 * makes it answer; otherwise it plays an older CUPTI that cannot tell. */
EXPORT CUptiResult cuptiActivityGetEnabledKinds(CUpti_SubscriberHandle s, CUpti_ActivityKind *buf, uint32_t *cap,
                                                uint32_t *count) {
    if (!getenv("STUB_CUPTI_ENABLED_KINDS")) return CUPTI_ERROR_NOT_SUPPORTED;
    uint32_t n = 0;
    for (int k = 0; k < 64; k++)
        if (enabled[k]) {
            if (buf && cap && n < *cap) buf[n] = (CUpti_ActivityKind)k;
            n++;
        }
    *count = n;
    return CUPTI_SUCCESS;
}

/* CUPTI >= 13.2 tells clients its record sizes; STUB_CUPTI_NO_STRUCT_SIZE plays an older one. */
EXPORT CUptiResult cuptiActivityGetStructSize(CUpti_ActivityKind kind, uint32_t version, size_t *size) {
    if (getenv("STUB_CUPTI_NO_STRUCT_SIZE")) return CUPTI_ERROR_NOT_SUPPORTED;
    *size = stub_size((int)kind);
    return *size ? CUPTI_SUCCESS : CUPTI_ERROR_INVALID_KIND;
}

EXPORT CUptiResult cuptiActivityRegisterTimestampCallback(uint64_t (*cb)(void)) {
    logf_("timestamp_callback");
    ts_cb = cb;
    return CUPTI_SUCCESS;
}

/* CLOCK_REALTIME ns, as the real 12.x/13.0 libraries return, or the registered source. */
EXPORT CUptiResult cuptiGetTimestamp(uint64_t *t) {
    check_alive("cuptiGetTimestamp");
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    *t = ts_cb ? ts_cb() : (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityGetAttribute_v2(CUpti_SubscriberHandle s, CUpti_ActivityAttribute a, size_t *n,
                                                void *v) {
    logf_("getattr2 %d", (int)a);
    if ((int)a == RL_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE && *n >= 1) {
        const char *st = getenv("STUB_CUPTI_MULTI_STATE");  /* what CUPTI reports; default 1 */
        if (st && !strcmp(st, "fail")) return CUPTI_ERROR_NOT_SUPPORTED;   /* cannot be read */
        *(uint8_t *)v = (uint8_t)(st ? atoi(st) : 1);
        return CUPTI_SUCCESS;
    }
    return CUPTI_ERROR_NOT_SUPPORTED;
}

/* cuptiActivitySetAttribute: logs attribute and value (size_t attributes only). */
EXPORT CUptiResult cuptiActivitySetAttribute(CUpti_ActivityAttribute a, size_t *n, void *v) {
    logf_("setattr %d %zu", (int)a, (n && *n == sizeof(size_t)) ? *(size_t *)v : (size_t)0);
    return CUPTI_SUCCESS;
}

/* NVTX 3's extension entry point (exported by the real libcupti.so.13, not by 12.x). */
EXPORT int InitializeInjectionNvtxExtension(void *export_function) {
    logf_("nvtx_ext_init %s", export_function ? "fn" : "null");
    return 1;
}

/* NVTX's injection entry point: libcupti implements it to receive NVTX calls. */
EXPORT int InitializeInjectionNvtx2(void *get_export_table) {
    logf_("nvtx_init %s", get_export_table ? "table" : "null");
    return 1;
}

/* ---- test controls ---- */

EXPORT int stub_deliver(const uint8_t *data, size_t len) {
    uint8_t *buf = NULL;
    size_t size = 0, maxrec = 0;
    if (req2) req2(&buf, &size, &maxrec, NULL);
    else if (req1) req1(&buf, &size, &maxrec);
    else return -2;
    if (!buf) return -1; /* the library refused a buffer: CUPTI would drop records */
    if (len > size) len = size;
    memcpy(buf, data, len);
    if (comp2) comp2(buf, size, len, NULL);
    else comp1(NULL, 0, buf, size, len);
    return 0;
}

/* Completes the buffer being filled, to whoever's completion callback is registered now
 * (CUPTI does not remember which client handed a buffer out). */
static void complete_current(void) {
    pthread_mutex_lock(&buf_lock);
    uint8_t *b = cur_buf;
    size_t size = cur_size, used = cur_used;
    CUpti_BuffersCallbackCompleteFunc c1 = comp1;
    rl_buffer_complete2_fn c2 = comp2;
    if (!b || !used) {
        pthread_mutex_unlock(&buf_lock);
        return;
    }
    cur_buf = NULL;
    cur_size = cur_used = 0;
    pthread_mutex_unlock(&buf_lock);
    if (c2) c2(b, size, used, NULL);
    else if (c1) c1(NULL, 0, b, size, used);
}

static uint8_t last_rec[1024];
static size_t last_rec_len;
EXPORT int stub_record(const uint8_t *data, size_t len);

/* STUB_CUPTI_EXIT_FLUSH: registered when the library dlopens the stub, i.e. before the
 * library's atexit handler, so it runs after it (atexit runs in reverse order). */
static void exit_flush(void) {
    if (!last_rec_len) return;
    uint8_t rec[1024];
    size_t n = last_rec_len;
    memcpy(rec, last_rec, n);
    stub_record(rec, n);
    complete_current();
}

__attribute__((constructor)) static void stub_init(void) {
    const char *e = getenv("STUB_CUPTI_EXIT_FLUSH");
    if (e && *e == '1') atexit(exit_flush);
}

/* A kernel finishing: its records (whole, of this stub's sizes) go into the current
 * buffer; a new buffer is requested when there is none or it is full. Only records of
 * enabled kinds are written, as in CUPTI. Returns records written. */
EXPORT int stub_record(const uint8_t *data, size_t len) {
    int n = 0;
    for (size_t off = 0; off + 8 <= len;) {
        int32_t kind;
        memcpy(&kind, data + off, 4);
        size_t sz = stub_size(kind);
        if (!sz || off + sz > len) break;
        if (!(kind >= 0 && kind < 64 && (enabled[kind] || req2))) {
            off += sz;
            continue;
        }
        pthread_mutex_lock(&buf_lock);
        if (cur_buf && cur_used + sz > cur_size) {
            pthread_mutex_unlock(&buf_lock);
            complete_current();
            pthread_mutex_lock(&buf_lock);
        }
        if (!cur_buf) {
            uint8_t *b = NULL;
            size_t size = 0, maxrec = 0;
            CUpti_BuffersCallbackRequestFunc r1 = req1;
            rl_buffer_request2_fn r2 = req2;
            pthread_mutex_unlock(&buf_lock);
            if (r2) r2(&b, &size, &maxrec, NULL);
            else if (r1) r1(&b, &size, &maxrec);
            pthread_mutex_lock(&buf_lock);
            if (!b) {   /* no buffer: CUPTI drops the record */
                pthread_mutex_unlock(&buf_lock);
                off += sz;
                continue;
            }
            cur_buf = b;
            cur_size = size;
            cur_used = 0;
            cur_owner = r2 ? (void *)r2 : (void *)r1;
        }
        memcpy(cur_buf + cur_used, data + off, sz);
        cur_used += sz;
        if (sz <= sizeof last_rec) {
            memcpy(last_rec, data + off, sz);
            last_rec_len = sz;
        }
        pthread_mutex_unlock(&buf_lock);
        off += sz;
        n++;
    }
    return n;
}

/* ---- torch.profiler on a legacy CUPTI: Kineto's CuptiActivityApi, call for call ---- */

static pthread_mutex_t kineto_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *kineto_bufs[4096];
static int kineto_nbufs, kineto_records_bytes;

static void CUPTIAPI kineto_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    pthread_mutex_lock(&kineto_lock);
    *buffer = NULL;
    *size = 0;
    *max_records = 0;
    if (kineto_nbufs < 4096) {
        /* kBufSize. Not from malloc: Kineto owns and frees its buffers itself, so a
         * free() of one by anyone else must fail loudly here (glibc aborts), not pass */
        void *m = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        *buffer = m == MAP_FAILED ? NULL : m;
        *size = *buffer ? 4 << 20 : 0;
        if (*buffer) kineto_bufs[kineto_nbufs++] = *buffer;
    }
    pthread_mutex_unlock(&kineto_lock);
}

static void CUPTIAPI kineto_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    pthread_mutex_lock(&kineto_lock);
    int mine = 0;
    for (int i = 0; i < kineto_nbufs; i++) mine |= kineto_bufs[i] == buffer;
    if (!mine) kineto_leaked++;       /* "bufferCompleted called with unknown buffer": dropped, leaked */
    else kineto_records_bytes += (int)valid;
    pthread_mutex_unlock(&kineto_lock);
}

/* Kineto's getApproximateTime (libkineto/src/ApproximateClock.h:77-79): __rdtsc(), ticks */
static uint64_t kineto_clock(void) { return (uint64_t)__rdtsc(); }

/* CuptiActivityProfiler start: CuptiCallbackApi subscribes, the timestamp source is set,
 * enableCuptiActivities registers Kineto's buffer callbacks and enables its kinds. */
EXPORT int stub_kineto_start(void) {
    CUpti_SubscriberHandle h;
    CUptiResult r = cuptiSubscribe(&h, NULL, NULL);
    cuptiActivityRegisterTimestampCallback(kineto_clock);
    cuptiActivityRegisterCallbacks(kineto_requested, kineto_completed);
    static const int kinds[] = {CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) cuptiActivityEnable((CUpti_ActivityKind)kinds[i]);
    return (int)r;
}

/* CuptiActivityProfiler stop: flushActivities (forced), disableCuptiActivities, and with
 * TEARDOWN_CUPTI=1 teardownContext ends in cuptiFinalize. Returns the buffers Kineto got
 * that were not its own (leaked). */
EXPORT int stub_kineto_stop(int finalize) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    static const int kinds[] = {CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) cuptiActivityDisable((CUpti_ActivityKind)kinds[i]);
    if (finalize) cuptiFinalize();
    return kineto_leaked;
}

EXPORT int stub_kineto_bytes(void) { return kineto_records_bytes; }

EXPORT size_t stub_log(char *out, size_t cap) {
    pthread_mutex_lock(&lock);
    size_t n = strlen(log_buf);
    if (cap) {
        size_t c = n < cap - 1 ? n : cap - 1;
        memcpy(out, log_buf, c);
        out[c] = 0;
    }
    pthread_mutex_unlock(&lock);
    return n;
}

/* A kernel of dur_ns as CUPTI reports it: start and end read from the timestamp source in
 * force (a registered one: CUPTI converts GPU timestamps through it, cupti_activity.h,
 * cuptiActivityRegisterTimestampCallback), the kernel "running" in between. The time that
 * really passed between the two reads (a loaded host preempts the busy wait, and the span
 * grows past dur_ns) is bracketed by CLOCK_REALTIME reads: stub_last_timed_span. */
static int64_t timed_lo_ns, timed_hi_ns;

static int64_t realtime_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

EXPORT void stub_last_timed_span(int64_t *lo, int64_t *hi) {
    *lo = timed_lo_ns;
    *hi = timed_hi_ns;
}

EXPORT int stub_record_timed(uint8_t *data, size_t len, uint64_t dur_ns) {
    uint64_t t0, t1;
    int64_t r0 = realtime_ns();
    cuptiGetTimestamp(&t0);
    int64_t r1 = realtime_ns();
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do clock_gettime(CLOCK_MONOTONIC, &b);
    while ((uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)(b.tv_nsec - a.tv_nsec) < dur_ns);
    int64_t r2 = realtime_ns();
    cuptiGetTimestamp(&t1);
    int64_t r3 = realtime_ns();
    timed_lo_ns = r2 - r1;
    timed_hi_ns = r3 - r0;
    if (len >= 32) {
        memcpy(data + 16, &t0, 8);
        memcpy(data + 24, &t1, 8);
    }
    return stub_record(data, len);
}

/* A stand-in libcupti for tests without a GPU (tests/test_native_cupti_stub.py).
 *
 * It exports the CUPTI entry points libridgeline_cupti.so resolves, records every call
 * in a log, and behaves as the environment says:
 *   STUB_CUPTI_VERSION=N            cuptiGetVersion result (default: the header's)
 *   STUB_CUPTI_OTHER_SUBSCRIBER=s   another tool holds CUPTI: subscribe fails with
 *                                   CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED naming s
 *   STUB_CUPTI_MULTI=1              multi-subscriber mode is available (CUDA >= 13.2, r610+)
 *   STUB_CUPTI_CONFLICT_KINDS=a,b   enabling these activity kinds fails (another user)
 *   STUB_CUPTI_DROPPED=N            records CUPTI reports dropped, once
 * and stub_deliver() plays CUPTI delivering a completed buffer: it asks the registered
 * request callback for a buffer, copies the records in, and calls the completion callback.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cupti_result.h>
#include <cupti_version.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[1 << 16];
static CUpti_BuffersCallbackRequestFunc req1;
static CUpti_BuffersCallbackCompleteFunc comp1;
static CUpti_BuffersCallbackRequestFunc_v2 req2;
static CUpti_BuffersCallbackCompleteFunc_v2 comp2;
static int dropped_reported;

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
                                     CUpti_SubscriberParams *p) {
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
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc r,
                                                  CUpti_BuffersCallbackCompleteFunc c) {
    logf_("register");
    req1 = r;
    comp1 = c;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityRegisterCallbacks_v2(CUpti_SubscriberHandle s, CUpti_BuffersCallbackRequestFunc_v2 r,
                                                     CUpti_BuffersCallbackCompleteFunc_v2 c) {
    logf_("register2");
    req2 = r;
    comp2 = c;
    return CUPTI_SUCCESS;
}

static CUptiResult enable_common(const char *what, CUpti_ActivityKind k) {
    logf_("%s %d", what, (int)k);
    if (!strncmp(what, "enable", 6) && in_list("STUB_CUPTI_CONFLICT_KINDS", (int)k))
        return CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityEnable(CUpti_ActivityKind k) { return enable_common("enable", k); }
EXPORT CUptiResult cuptiActivityDisable(CUpti_ActivityKind k) { return enable_common("disable", k); }
EXPORT CUptiResult cuptiActivityEnable_v2(CUpti_SubscriberHandle s, CUpti_ActivityKind k, CUpti_ActivityConfig *c) {
    return enable_common("enable2", k);
}
EXPORT CUptiResult cuptiActivityDisable_v2(CUpti_SubscriberHandle s, CUpti_ActivityKind k, CUpti_ActivityConfig *c) {
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
EXPORT CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    logf_("flushall %u", flag);
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext c, uint32_t s, size_t *n) {
    const char *d = getenv("STUB_CUPTI_DROPPED");
    *n = (d && !dropped_reported) ? (size_t)atol(d) : 0;
    dropped_reported = 1;
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityGetNextRecord(uint8_t *b, size_t v, CUpti_Activity **r) {
    logf_("getnextrecord");
    return CUPTI_ERROR_MAX_LIMIT_REACHED;
}

EXPORT CUptiResult cuptiActivityGetAttribute_v2(CUpti_SubscriberHandle s, CUpti_ActivityAttribute a, size_t *n,
                                                void *v) {
    logf_("getattr2 %d", (int)a);
    if (a == CUPTI_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE && *n >= 1) {
        const char *st = getenv("STUB_CUPTI_MULTI_STATE");  /* what CUPTI reports; default 1 */
        *(uint8_t *)v = (uint8_t)(st ? atoi(st) : 1);
        return CUPTI_SUCCESS;
    }
    return CUPTI_ERROR_NOT_SUPPORTED;
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

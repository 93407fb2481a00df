/* libkineto_replay.so (tests only): the CUPTI calls torch.profiler makes on a legacy
 * (single-subscriber) CUPTI, in the order and with the arguments of pytorch/kineto's
 * libkineto/src at 0f9bef9a (2026-02-20; the functions cited are unchanged from 445bc4f5,
 * 2026-02-02, to 3a616572, 2026-03-24, around torch 2.11's branch cut). Linked against the
 * stand-in libcupti the way libtorch links libcupti (DT_NEEDED), so that a preloaded
 * libridgeline_cupti.so sees these calls first, as it would libtorch's.
 *
 * Kineto's buffers are its own (CuptiActivityBuffer, a std::vector): mmap'ed here so that
 * a free() of one by anyone else aborts instead of passing.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cupti_result.h>
#include <cupti_version.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_runtime_cbid.h>
#include <cupti_driver_cbid.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <x86intrin.h>

#define EXPORT __attribute__((visibility("default")))

/* CuptiActivityApi.cpp:27 kBufSize; Config.cpp:42 kDefaultActivitiesMaxGpuBufferSize 128 MB,
 * CuptiActivityApi.cpp:111-113 maxGpuBufferCount_ = 1 + size / kBufSize */
#define K_BUF_SIZE ((size_t)4 << 20)
#define K_MAX_BUFS (1 + (128 << 20) / (4 << 20))

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* CuptiActivityApi::mutex_ */
static uint8_t *allocated[4096];                      /* allocatedGpuTraceBuffers_ */
static int n_allocated;
static struct { uint8_t *b; size_t valid; } ready[4096]; /* readyGpuTraceBuffers_ */
static int n_ready;
static int unknown_buffers;  /* "bufferCompleted called with unknown buffer" */
static int tracing_enabled;  /* tracingEnabled_ */
/* what processTrace found: kernel correlation ids, per kind counts */
static uint32_t kernel_corr[1 << 16];
static int n_kernel_corr, records_by_kind[64];
static uint64_t kernel_start[1 << 16], kernel_end[1 << 16];

/* CuptiActivityApi.cpp:144-163 bufferRequested */
static void CUPTIAPI bufferRequested(uint8_t **buffer, size_t *size, size_t *maxNumRecords) {
    pthread_mutex_lock(&mu);
    /* :150-155 past maxGpuBufferCount_ it sets stopCollection and still allocates */
    void *m = mmap(NULL, K_BUF_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    *buffer = m == MAP_FAILED ? NULL : m;
    *size = *buffer ? K_BUF_SIZE : 0;
    if (*buffer && n_allocated < 4096) allocated[n_allocated++] = *buffer;
    *maxNumRecords = 0;
    pthread_mutex_unlock(&mu);
}

/* CuptiActivityApi.cpp:260-292 bufferCompleted */
static void CUPTIAPI bufferCompleted(CUcontext ctx, uint32_t streamId, uint8_t *buffer, size_t size,
                                     size_t validSize) {
    pthread_mutex_lock(&mu);
    int at = -1;
    for (int i = 0; i < n_allocated; i++)
        if (allocated[i] == buffer) at = i;
    if (at < 0) {
        /* :266-272 LOG(ERROR) "bufferCompleted called with unknown buffer"; return */
        fprintf(stderr, "kineto: bufferCompleted called with unknown buffer: %p\n", (void *)buffer);
        unknown_buffers++;
        pthread_mutex_unlock(&mu);
        return;
    }
    /* :274-281 moved to readyGpuTraceBuffers_, erased from allocatedGpuTraceBuffers_ */
    if (n_ready < 4096) {
        ready[n_ready].b = buffer;
        ready[n_ready].valid = validSize;
        n_ready++;
    }
    allocated[at] = allocated[--n_allocated];
    pthread_mutex_unlock(&mu);
}

/* ApproximateClock.h:77-79 getApproximateTime: __rdtsc() on x86 */
static uint64_t getApproximateTime(void) { return (uint64_t)__rdtsc(); }

static const CUpti_ActivityKind KINDS[] = {
    /* torch.profiler's default CUDA activities (ProfilerActivity.CUDA): CuptiActivityApi.cpp
     * :322-361 in this order */
    CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
    CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

/* CuptiActivityApi.cpp:232-249 clearActivities */
static void clearActivities(void) {
    pthread_mutex_lock(&mu);
    int empty = n_allocated == 0;
    pthread_mutex_unlock(&mu);
    if (empty) return;
    cuptiActivityFlushAll(0);
    pthread_mutex_lock(&mu);
    for (int i = 0; i < n_ready; i++) munmap(ready[i].b, K_BUF_SIZE); /* readyGpuTraceBuffers_ = nullptr */
    n_ready = 0;
    pthread_mutex_unlock(&mu);
}

/* GenericActivityProfiler::configure (GenericActivityProfiler.cpp:469-568): the clock
 * converter (:477-478), resetTraceData (:785-789: clearActivities, teardownContext, a no-op
 * while !tracingEnabled_), then enableGpuTracing (:534 -> CuptiActivityProfiler.cpp:111-131):
 * the TSC timestamp source (:120-123, use_cupti_tsc() defaults to true, Config.h:527), then
 * enableCuptiActivities (CuptiActivityApi.cpp:294-369). Returns the first failing result. */
EXPORT int kineto_configure(int use_tsc) {
    clearActivities();
    memset(records_by_kind, 0, sizeof records_by_kind);
    n_kernel_corr = 0;
    CUptiResult r = CUPTI_SUCCESS, x;
    if (use_tsc && (x = cuptiActivityRegisterTimestampCallback(getApproximateTime)) != CUPTI_SUCCESS) r = x;
    if ((x = cuptiActivityRegisterCallbacks(bufferRequested, bufferCompleted)) != CUPTI_SUCCESS && !r) r = x; /* :318 */
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++) {
        if ((x = cuptiActivityEnable(KINDS[i])) != CUPTI_SUCCESS && !r) r = x;
#if CUPTI_API_VERSION >= 23 /* Kineto: CUDART_VERSION >= 12050; 12.4's header (API 22) lacks these */
        if (KINDS[i] == CUPTI_ACTIVITY_KIND_RUNTIME) /* :344-347 (CUDART >= 12.5) */
            cuptiActivityEnableRuntimeApi(CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020, 0);
        if (KINDS[i] == CUPTI_ACTIVITY_KIND_DRIVER) { /* :351-358 */
            cuptiActivityEnableDriverApi(CUPTI_DRIVER_TRACE_CBID_cuKernelGetAttribute, 0);
            cuptiActivityEnableDriverApi(CUPTI_DRIVER_TRACE_CBID_cuDevicePrimaryCtxGetState, 0);
            cuptiActivityEnableDriverApi(CUPTI_DRIVER_TRACE_CBID_cuCtxGetCurrent, 0);
        }
#endif
    }
    tracing_enabled = 1;
    return (int)r;
}

/* GenericActivityProfiler::stopTraceInternal (:615-644) -> disableGpuTracing
 * (CuptiActivityProfiler.cpp:132-134) -> disableCuptiActivities (CuptiActivityApi.cpp:371-401) */
EXPORT void kineto_stop(void) {
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++) cuptiActivityDisable(KINDS[i]);
}

/* processTraceInternal (:192) -> processGpuActivities (CuptiActivityProfiler.cpp:182-184)
 * -> activityBuffers (CuptiActivityApi.cpp:165-199): nothing at all when none of its
 * buffers is outstanding (:166-171), else a forced flush (:181) and the ready buffers,
 * walked with cuptiActivityGetNextRecord (:93-109, :201-213). Returns records found. */
EXPORT int kineto_process(void) {
    pthread_mutex_lock(&mu);
    int empty = n_allocated == 0;
    pthread_mutex_unlock(&mu);
    if (empty) return -1; /* "return nullptr": the trace has no GPU events */
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&mu);
    int total = 0;
    for (int i = 0; i < n_ready; i++) {
        CUpti_Activity *rec = NULL;
        while (cuptiActivityGetNextRecord(ready[i].b, ready[i].valid, &rec) == CUPTI_SUCCESS) {
            int32_t kind;
            memcpy(&kind, rec, 4);
            if (kind >= 0 && kind < 64) records_by_kind[kind]++;
            if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && n_kernel_corr < (1 << 16)) {
                /* correlationId, start, end: the same offsets in every kernel layout */
                uint32_t c;
                memcpy(&c, (uint8_t *)rec + offsetof(CUpti_ActivityKernel9, correlationId), 4);
                memcpy(&kernel_start[n_kernel_corr], (uint8_t *)rec + 16, 8);
                memcpy(&kernel_end[n_kernel_corr], (uint8_t *)rec + 24, 8);
                kernel_corr[n_kernel_corr++] = c;
            }
            total++;
        }
        munmap(ready[i].b, K_BUF_SIZE);
    }
    n_ready = 0;
    pthread_mutex_unlock(&mu);
    return total;
}

/* resetTraceData (GenericActivityProfiler.cpp:785-789): clearActivities, then
 * teardownContext (CuptiActivityApi.cpp:403-460): with TEARDOWN_CUPTI=1 (:29-32) a forced
 * flush (:439) and cuptiFinalize (from a callback, here directly). */
EXPORT void kineto_reset(void) {
    clearActivities();
    const char *t = getenv("TEARDOWN_CUPTI");
    if (tracing_enabled && t && !strcmp(t, "1")) {
        cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
        cuptiFinalize();
        tracing_enabled = 0;
    }
}

EXPORT int kineto_unknown_buffers(void) { return unknown_buffers; }
EXPORT int kineto_outstanding(void) { return n_allocated; }
EXPORT int kineto_records(int kind) { return kind >= 0 && kind < 64 ? records_by_kind[kind] : 0; }
EXPORT int kineto_kernels(uint32_t *corr, uint64_t *start, uint64_t *end, int cap) {
    int n = n_kernel_corr < cap ? n_kernel_corr : cap;
    memcpy(corr, kernel_corr, (size_t)n * 4);
    memcpy(start, kernel_start, (size_t)n * 8);
    memcpy(end, kernel_end, (size_t)n * 8);
    return n;
}

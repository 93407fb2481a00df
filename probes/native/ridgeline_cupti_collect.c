/* libcupti: loaded with dlopen and resolved with dlsym, claimed (subscribed), and told what
 * to record (activity kinds, and which runtime/driver API calls).
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* ------------------------------------------------------------------------------------ */
/* libcupti entry points, resolved with dlsym                                            */

struct rl_cupti C;

/* ------------------------------------------------------------------------------------ */
/* which API calls are recorded: launch, graph launch and synchronisation only            */

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
const cbid_ent_t CBIDS[] = {
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
const size_t rl_n_cbids = sizeof CBIDS / sizeof CBIDS[0];

/* ------------------------------------------------------------------------------------ */
/* enabling activity kinds (v1 global API, or v2 per-subscriber in multi-subscriber mode) */

CUptiResult kind_set(CUpti_ActivityKind k, int on) {
    if (g_multi) return on ? C.Enable2(g_sub, k, NULL) : C.Disable2(g_sub, k, NULL);
    return on ? C.Enable(k) : C.Disable(k);
}

CUptiResult api_set(const cbid_ent_t *e, int on) {
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
void apply_mode(int mode, int initial) {
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

void *load_cupti(char *why, size_t why_cap) {
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

int resolve_cupti(char *why, size_t why_cap) {
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
int claim_cupti(void) {
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

int setup_collection(void) {
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

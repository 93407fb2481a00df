/* A stand-in served process for bench/bench_served.py: it "launches" kernels at a set
 * rate and plays CUPTI writing each launch's records (one kernel record and one runtime
 * API record, cudaLaunchKernel) through the stand-in libcupti's stub_record, the call CUPTI
 * makes when a kernel completes (probes/native/tests/stub_cupti.c). It prints its own CPU
 * (all threads: getrusage(RUSAGE_SELF), so the injection library's flush and sender
 * threads count) over the launch loop and a linger after it.
 *
 *   served_app MODE LAUNCHES RATE_HZ LINGER_MS
 *
 * MODE:
 *   bare      no CUPTI at all: the loop builds each launch's records and throws them away
 *             (an uninjected process; the loop's own cost is the floor of every mode)
 *   cupti     the stand-in libcupti (STUB path in $RIDGELINE_LIBCUPTI) with a minimal
 *             client made here (one recycled buffer, completion ignored): what CUPTI's
 *             record writing costs without the injection library
 *   inject    the injection library ($CUDA_INJECTION64_PATH) set up as the driver does
 *             (InitializeInjection), which dlopens $RIDGELINE_LIBCUPTI itself
 * The library's own cost per launch is inject - cupti.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <cupti_activity.h>
#include <cupti_callbacks.h>
#include <cupti_runtime_cbid.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* The stand-in writes kernel records of its header's release (stub_cupti.c STUB_KERNEL_SIZE). */
#if CUPTI_API_VERSION >= 130401
typedef CUpti_ActivityKernel13 kernel_rec;
#else
typedef CUpti_ActivityKernel9 kernel_rec;
#endif

static uint64_t now_ns(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static uint64_t cpu_ns(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (uint64_t)(r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000000ull +
           (uint64_t)(r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1000ull;
}

/* cupti mode's client: one buffer, handed out again each time CUPTI asks. */
static uint8_t client_buf[1 << 20] __attribute__((aligned(8)));
static void CUPTIAPI client_request(uint8_t **b, size_t *size, size_t *max) {
    *b = client_buf;
    *size = sizeof client_buf;
    *max = 0;
}
static void CUPTIAPI client_complete(CUcontext c, uint32_t s, uint8_t *b, size_t size, size_t valid) {
    (void)c; (void)s; (void)b; (void)size; (void)valid;
}

/* A few distinct kernel names, as an engine's step launches them (the library interns
 * them by pointer). */
static const char *const NAMES[] = {
    "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, true>(Flash_fwd_params)",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "void vllm::rms_norm_kernel<c10::BFloat16, 8, 3>(c10::BFloat16*, c10::BFloat16 const*, long, c10::BFloat16 const*, float, int, int)",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>(c10::BFloat16 const&)), true>(c10::BFloat16*, c10::BFloat16 const*, int)",
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, long const*, long, long, long, long, int, int, int, float const*, float const*)",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
};

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: served_app bare|cupti|inject LAUNCHES RATE_HZ LINGER_MS\n");
        return 2;
    }
    const char *mode = argv[1];
    long launches = atol(argv[2]);
    double rate = atof(argv[3]);
    long linger_ms = atol(argv[4]);
    int (*record)(const uint8_t *, size_t) = NULL;
    int injected = 0;
    if (strcmp(mode, "bare") != 0) {
        const char *stub = getenv("RIDGELINE_LIBCUPTI");
        void *h = stub ? dlopen(stub, RTLD_NOW | RTLD_GLOBAL) : NULL;
        if (!h) {
            fprintf(stderr, "served_app: cannot load the stand-in libcupti (RIDGELINE_LIBCUPTI): %s\n", dlerror());
            return 2;
        }
        record = (int (*)(const uint8_t *, size_t))dlsym(h, "stub_record");
        if (strcmp(mode, "inject") == 0) {
            const char *path = getenv("CUDA_INJECTION64_PATH");
            void *lib = path ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
            int (*init)(void) = lib ? (int (*)(void))dlsym(lib, "InitializeInjection") : NULL;
            if (!init) {
                fprintf(stderr, "served_app: cannot load the injection library: %s\n", dlerror());
                return 2;
            }
            injected = init();
        } else {
            CUptiResult (*reg)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) =
                (CUptiResult (*)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc))dlsym(
                    h, "cuptiActivityRegisterCallbacks");
            CUptiResult (*en)(CUpti_ActivityKind) = (CUptiResult (*)(CUpti_ActivityKind))dlsym(h, "cuptiActivityEnable");
            if (!reg || !en || reg(client_request, client_complete) != CUPTI_SUCCESS ||
                en(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS || en(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS) {
                fprintf(stderr, "served_app: the stand-in libcupti refused the minimal client\n");
                return 2;
            }
        }
    }
    /* both records are 8-byte aligned types of a multiple of 8 bytes: no padding between */
    struct {
        kernel_rec k;
        CUpti_ActivityAPI a;
    } rec;
    _Static_assert(sizeof rec == sizeof(kernel_rec) + sizeof(CUpti_ActivityAPI), "records back to back");
    memset(&rec, 0, sizeof rec);
    uint32_t pid = (uint32_t)getpid(), tid = (uint32_t)gettid();
    uint64_t period_ns = rate > 0 ? (uint64_t)(1e9 / rate) : 0;
    const long chunk = 50;                 /* launches between two pacing sleeps */
    uint64_t c0 = cpu_ns(), w0 = now_ns(CLOCK_MONOTONIC), t = w0;
    volatile uint64_t sink = 0;
    for (long i = 0; i < launches; i++) {
        uint64_t ts = now_ns(CLOCK_REALTIME);
        rec.k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        rec.k.start = ts + 5000;
        rec.k.end = ts + 5000 + 2000 + (uint64_t)(i % 7) * 100;
        rec.k.deviceId = 0;
        rec.k.contextId = 1;
        rec.k.streamId = 7;
        rec.k.gridX = 132;
        rec.k.gridY = 1 + (int32_t)(i % 3);
        rec.k.gridZ = 1;
        rec.k.blockX = 128;
        rec.k.blockY = 1;
        rec.k.blockZ = 1;
        rec.k.registersPerThread = 64;
        rec.k.correlationId = (uint32_t)(i + 1);
        rec.k.name = NAMES[i % (long)(sizeof NAMES / sizeof NAMES[0])];
        rec.a.kind = CUPTI_ACTIVITY_KIND_RUNTIME;
        rec.a.cbid = CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000;
        rec.a.start = ts;
        rec.a.end = ts + 2500;
        rec.a.processId = pid;
        rec.a.threadId = tid;
        rec.a.correlationId = (uint32_t)(i + 1);
        if (record) record((const uint8_t *)&rec, sizeof rec);
        else sink += rec.k.end ^ rec.a.start;      /* bare: the records are built, not kept */
        if (period_ns && (i + 1) % chunk == 0) {
            t += period_ns * chunk;
            struct timespec d = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
            clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &d, NULL);
        }
    }
    uint64_t w1 = now_ns(CLOCK_MONOTONIC);
    /* the library's threads flush and send what is left */
    struct timespec l = {linger_ms / 1000, (linger_ms % 1000) * 1000000L};
    if (linger_ms > 0) nanosleep(&l, NULL);
    uint64_t c1 = cpu_ns();
    printf("{\"mode\": \"%s\", \"launches\": %ld, \"injected\": %d, \"cpu_ns\": %llu, \"loop_wall_ns\": %llu, "
           "\"record_bytes\": %zu}\n",
           mode, launches, injected, (unsigned long long)(c1 - c0), (unsigned long long)(w1 - w0), sizeof rec);
    fflush(stdout);
    return 0;
}

/* libforeign_tool.so (tests only): another tool's CUDA injection library, as a tool that
 * owns CUDA_INJECTION64_PATH is built: its InitializeInjection subscribes to CUPTI through
 * the libcupti it links (DT_NEEDED, here the stand-in), which lands outside the global
 * scope because the driver dlopens injection libraries with RTLD_LOCAL (as
 * ridgeline_inject_app does). With libridgeline_cupti.so preloaded (ridgeline run's
 * LD_PRELOAD inherited), these calls reach Ridgeline's entry points first; they must still
 * reach this tool's libcupti and succeed. It prints what CUPTI answered. */
#include <cuda.h>
#include <cupti_result.h>
#include <cupti_activity.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define EXPORT __attribute__((visibility("default")))

static uint8_t buf[1 << 16];

static void CUPTIAPI req(uint8_t **b, size_t *size, size_t *max_records) {
    *b = buf;
    *size = sizeof buf;
    *max_records = 0;
}

static void CUPTIAPI comp(CUcontext ctx, uint32_t stream, uint8_t *b, size_t size, size_t valid) {}

EXPORT int InitializeInjection(void) {
    CUptiResult r = cuptiActivityRegisterCallbacks(req, comp);
    CUptiResult e = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    CUptiResult f = cuptiActivityFlushAll(0);
    printf("tool: register=%d enable=%d flush=%d\n", (int)r, (int)e, (int)f);
    fflush(stdout);
    return 1;
}

/* Stand-in for the CUDA driver library (libcuda.so.1) so the driver-API uprobes can be tested
 * without a GPU: the exported functions have the driver's signatures and return
 * CUDA_ERROR_STUB_LIBRARY (34). Built by tests/test_cuda_uprobes.py at test time:
 *   gcc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuda_driver_stub.c
 * Adapted from the stub in ../shared/docs/reference/ebpf.md section 8.7 (see tests/data/PROVENANCE.md). */
#include <stddef.h>
typedef int CUresult;
#define STUB 34
#define KEEP __attribute__((noinline, visibility("default")))
#define BODY { __asm__ volatile("" ::: "memory"); return STUB; }
KEEP CUresult cuInit(unsigned flags) BODY
KEEP CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                             unsigned shmem, void *stream, void **params, void **extra) BODY
KEEP CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) BODY
KEEP CUresult cuGraphLaunch(void *exec, void *stream) BODY
KEEP CUresult cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) BODY
KEEP CUresult cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) BODY
KEEP CUresult cuMemcpyDtoDAsync_v2(unsigned long long dst, unsigned long long src, size_t n, void *stream) BODY
KEEP CUresult cuMemcpyPeer(unsigned long long dst, void *dctx, unsigned long long src, void *sctx, size_t n) BODY
KEEP CUresult cuStreamSynchronize(void *stream) BODY
KEEP CUresult cuCtxSynchronize(void) BODY
KEEP CUresult cuEventSynchronize(void *event) BODY

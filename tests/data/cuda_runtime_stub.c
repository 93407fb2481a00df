/* Stand-in for the CUDA runtime (named libcudart.so.99 by the test) whose calls go through the
 * driver stub's exported functions, as the real runtime calls the driver. It lets
 * tests/test_cuda_uprobes.py check that driver calls made inside runtime calls are counted
 * once (as nested), without a GPU. Built at test time against cuda_driver_stub.c's library. */
typedef int CUresult;
extern CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned shmem, void *stream, void **params, void **extra);
extern CUresult cuStreamSynchronize(void *stream);
#define KEEP __attribute__((noinline, visibility("default")))
typedef struct { unsigned x, y, z; } dim3;
KEEP int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, unsigned long shmem, void *stream) {
  return cuLaunchKernel((void *)func, grid.x, grid.y, grid.z, block.x, block.y, block.z, (unsigned)shmem, stream, args, 0);
}
KEEP int cudaStreamSynchronize(void *stream) { return cuStreamSynchronize(stream); }

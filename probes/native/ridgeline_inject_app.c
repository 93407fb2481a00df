/* Stand-in "application" for tests of the injection library without a GPU.
 *
 * Without a driver, libcuda never calls InitializeInjection, so this program does what
 * the driver does: dlopen CUDA_INJECTION64_PATH and call InitializeInjection. Then it
 * does its own work (sums 1..N) and prints the result, which shows the application ran
 * on untouched whatever the library found. Usage: ridgeline_inject_app [N [LINGER_MS]].
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    const char *path = getenv("CUDA_INJECTION64_PATH");
    int injected = -1;
    if (path && *path) {
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            fprintf(stderr, "app: cannot load injection: %s\n", dlerror());
        } else {
            int (*init)(void) = (int (*)(void))dlsym(h, "InitializeInjection");
            injected = init ? init() : -2;
        }
    }
    long sum = 0;
    for (long i = 1; i <= n; i++) sum += i;
    printf("app: injection=%d sum=%ld\n", injected, sum);
    fflush(stdout);
    /* optional: stay alive a while (argv[2] ms) so the library's thread can reach the agent */
    long linger_ms = argc > 2 ? atol(argv[2]) : 0;
    struct timespec ts = {linger_ms / 1000, (linger_ms % 1000) * 1000000L};
    if (linger_ms > 0) nanosleep(&ts, NULL);
    return 0;
}

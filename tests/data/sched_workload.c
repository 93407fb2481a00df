// Ground-truth workload for the scheduling probe's accuracy tests (tests/test_sched_accuracy.py).
// Adapted from the workload.c of ../shared/docs/reference/ebpf.md section 8.2; see tests/data/PROVENANCE.md.
//
// Threads: NBUSY busy-loop threads pinned to BUSY_CPU for BUSY_SECS, and one sleeper thread
// pinned to SLEEP_CPU doing ITERS x nanosleep(SLEEP_MS).
// Protocol (stdin/stdout, one line each):
//   -> "READY <pid> <tid_busy0> ... <tid_sleeper>"   workers parked on a barrier
//   <- "GO"                                          the harness has added the target
//   -> "DONE <json>"  after every worker has parked again (blocked on its own semaphore)
//   <- "EXIT"
// The JSON holds per-thread deltas of /proc/<pid>/task/<tid>/schedstat (on-CPU ns, run-queue
// wait ns) and of status (voluntary/nonvoluntary switches), read while the workers are parked,
// the CLOCK_MONOTONIC time each worker parked (park_ns), and the sleeper's self-measured sleep.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int NBUSY = 2, BUSY_CPU = 1, SLEEP_CPU = 0, ITERS = 100;
static double BUSY_SECS = 1.0, SLEEP_MS = 10.0;
static pthread_barrier_t start_bar;
static pid_t tids[64];
static double slept_ns_total = 0, park_ns[64];
static sem_t done_sem, exit_sem[64];

static double now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void pin(int cpu) { if (cpu < 0) return; cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); sched_setaffinity(0, sizeof s, &s); }
// Each worker parks on its own semaphore so that no other thread's progress wakes it.
static void park(long i) { park_ns[i] = now_ns(); sem_post(&done_sem); while (sem_wait(&exit_sem[i]) != 0) {} }

static void *busy(void *a) {
  long i = (long)a; tids[i] = syscall(SYS_gettid); pin(BUSY_CPU);
  pthread_barrier_wait(&start_bar);
  double end = now_ns() + BUSY_SECS * 1e9; volatile unsigned long x = 0;
  while (now_ns() < end) for (int k = 0; k < 1000; k++) x++;
  park(i); return NULL;
}

static void *sleeper(void *a) {
  long i = (long)a; tids[i] = syscall(SYS_gettid); pin(SLEEP_CPU);
  pthread_barrier_wait(&start_bar);
  struct timespec ts = { (time_t)(SLEEP_MS / 1000), (long)((SLEEP_MS - 1000 * (long)(SLEEP_MS / 1000)) * 1e6) };
  for (int k = 0; k < ITERS; k++) { double s = now_ns(); nanosleep(&ts, NULL); slept_ns_total += now_ns() - s; }
  park(i); return NULL;
}

static void read_task(pid_t pid, pid_t tid, unsigned long long *exec, unsigned long long *delay, long *vcs, long *ivcs) {
  char p[128], line[256]; FILE *f;
  snprintf(p, sizeof p, "/proc/%d/task/%d/schedstat", pid, tid);
  f = fopen(p, "r"); if (f) { unsigned long long c; if (fscanf(f, "%llu %llu %llu", exec, delay, &c) != 3) *exec = *delay = 0; fclose(f); }
  snprintf(p, sizeof p, "/proc/%d/task/%d/status", pid, tid);
  f = fopen(p, "r"); if (!f) return;
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "voluntary_ctxt_switches:", 24)) *vcs = atol(line + 24);
    if (!strncmp(line, "nonvoluntary_ctxt_switches:", 27)) *ivcs = atol(line + 27);
  }
  fclose(f);
}

int main(int argc, char **argv) {
  if (argc > 1) NBUSY = atoi(argv[1]);
  if (argc > 2) BUSY_CPU = atoi(argv[2]);
  if (argc > 3) BUSY_SECS = atof(argv[3]);
  if (argc > 4) SLEEP_MS = atof(argv[4]);
  if (argc > 5) ITERS = atoi(argv[5]);
  if (argc > 6) SLEEP_CPU = atoi(argv[6]);
  int n = NBUSY + 1; pthread_t th[64];
  pthread_barrier_init(&start_bar, NULL, n + 1);
  sem_init(&done_sem, 0, 0); for (int i = 0; i < n; i++) sem_init(&exit_sem[i], 0, 0);
  for (long i = 0; i < NBUSY; i++) pthread_create(&th[i], NULL, busy, (void *)i);
  pthread_create(&th[NBUSY], NULL, sleeper, (void *)(long)NBUSY);
  while (1) { int ok = 1; for (int i = 0; i < n; i++) if (!__atomic_load_n(&tids[i], __ATOMIC_SEQ_CST)) ok = 0; if (ok) break; usleep(1000); }
  usleep(50000);  // let the workers reach the barrier (blocked)
  pid_t pid = getpid();
  printf("READY %d", pid); for (int i = 0; i < n; i++) printf(" %d", tids[i]); printf("\n"); fflush(stdout);
  char buf[64]; if (!fgets(buf, sizeof buf, stdin)) return 1;
  unsigned long long e0[64] = {0}, d0[64] = {0}, e1[64] = {0}, d1[64] = {0};
  long v0[64] = {0}, i0[64] = {0}, v1[64] = {0}, i1[64] = {0};
  for (int i = 0; i < n; i++) read_task(pid, tids[i], &e0[i], &d0[i], &v0[i], &i0[i]);
  pthread_barrier_wait(&start_bar);
  for (int i = 0; i < n; i++) while (sem_wait(&done_sem) != 0) {}
  usleep(100000);  // the workers are now blocked on their semaphores
  for (int i = 0; i < n; i++) read_task(pid, tids[i], &e1[i], &d1[i], &v1[i], &i1[i]);
  printf("DONE {\"threads\":[");
  for (int i = 0; i < n; i++)
    printf("%s{\"tid\":%d,\"role\":\"%s\",\"exec_ns\":%llu,\"run_delay_ns\":%llu,\"nvcsw\":%ld,\"nivcsw\":%ld,\"park_ns\":%.0f}",
           i ? "," : "", tids[i], i < NBUSY ? "busy" : "sleeper", e1[i] - e0[i], d1[i] - d0[i], v1[i] - v0[i], i1[i] - i0[i], park_ns[i]);
  printf("],\"slept_ns\":%.0f,\"sleep_iters\":%d,\"sleep_ms\":%g}\n", slept_ns_total, ITERS, SLEEP_MS); fflush(stdout);
  if (!fgets(buf, sizeof buf, stdin)) {}
  for (int i = 0; i < n; i++) sem_post(&exit_sem[i]);
  for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
  return 0;
}

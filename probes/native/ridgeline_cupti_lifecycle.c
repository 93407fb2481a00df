/* The process's life: the pool allocated, fork, exit and SIGTERM handled so records ship.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

int alloc_pool(void) {
    g_slot_cap = cfg.buffer_bytes + RL_KIND_MAX * sizeof(rl_section_t);
    g_slots = calloc(cfg.pool_slots, sizeof *g_slots);
    if (!g_slots) return -1;
    for (unsigned i = 0; i < cfg.pool_slots; i++) {
        g_slots[i].data = malloc(g_slot_cap);
        if (!g_slots[i].data) return -1;
    }
    return names_alloc();
}

/* fork(): our locks are taken around the fork so a child never inherits one held by a
 * thread that does not exist there (it would wait forever on it). */
void at_fork_prepare(void) {
    pthread_mutex_lock(&g_start_lock);
    pthread_mutex_lock(&g_pool_lock);
    pthread_mutex_lock(&g_names_lock);
    pthread_mutex_lock(&g_status_lock);
}

void at_fork_parent(void) {
    pthread_mutex_unlock(&g_status_lock);
    pthread_mutex_unlock(&g_names_lock);
    pthread_mutex_unlock(&g_pool_lock);
    pthread_mutex_unlock(&g_start_lock);
}

void at_fork_child(void) {
    at_fork_parent();
    /* Threads do not survive fork; the first buffer completed in the child restarts the sender. */
    atomic_store(&g_sender_running, 0);
    g_pid = getpid();
    /* pipes shared with the parent would cross its signals and peeks with ours */
    for (int i = 0; i < 2; i++) {
        if (g_wake_pipe[i] >= 0) close(g_wake_pipe[i]);
        if (g_ack_pipe[i] >= 0) close(g_ack_pipe[i]);
        if (g_peek_pipe[i] >= 0) close(g_peek_pipe[i]);
        g_wake_pipe[i] = g_ack_pipe[i] = g_peek_pipe[i] = -1;
    }
    if (make_pipe(g_peek_pipe)) g_peek_pipe[0] = g_peek_pipe[1] = -1;
}

int g_init_pid;

/* After our atexit handler come libcupti's and the driver's static destructors (the real
 * libcupti.so.12/13 have C++ ones): the sender must not tick a flush into them, nor be
 * started again by a buffer CUPTI completes later. It is told to stop and joined, bounded
 * (each loop turn waits at most ~50 ms, plus a flush); past the bound it is left as it is
 * rather than holding up the exit. */
static void stop_sender_at_exit(void) {
    /* a buffer CUPTI completes later (context teardown) must not start a new sender */
    atomic_store(&g_exiting, 1);
    if (!atomic_load(&g_sender_running)) return;
    atomic_store(&g_stop, 1);
    pthread_mutex_lock(&g_pool_lock);
    pthread_cond_broadcast(&g_pool_cond);
    pthread_mutex_unlock(&g_pool_lock);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 1;
    if (pthread_timedjoin_np(g_sender, NULL, &until) == 0) atomic_store(&g_sender_running, 0);
}

void at_exit(void) {
    if (!atomic_load(&g_active)) return;
    /* A forked child inherits this handler but not CUDA: it must not touch CUPTI or wait. */
    if (getpid() != g_init_pid) return;
    /* Completed buffers only (flag 0): a forced flush hands back running kernels with end=0. */
    if (cfg.exit_flush && collecting()) (void)C.FlushAll(0);
    /* give the sender a short, bounded chance to ship what is queued */
    uint64_t until = now_ms() + cfg.stop_flush_ms;
    while (now_ms() < until && atomic_load(&g_sender_running)) {
        int busy = 0;
        pthread_mutex_lock(&g_pool_lock);
        for (unsigned i = 0; i < cfg.pool_slots; i++) busy |= g_slots[i].state != SLOT_FREE;
        pthread_mutex_unlock(&g_pool_lock);
        /* a batch taken from its slot may still be on its way out */
        if (!busy && !atomic_load(&g_send_pending)) break;
        usleep(5000);
    }
    stop_sender_at_exit();
}

/* SIGTERM. A process without a SIGTERM handler of its own (SIG_DFL: a TP worker killed by
 * its launcher) dies without running atexit, losing the partial buffers. Only in that
 * case do we install a handler, and it keeps the default's meaning: it wakes the sender
 * (write(2), async-signal-safe), waits at most RIDGELINE_STOP_FLUSH_MS for it to flush
 * and ship (poll(2)), puts SIG_DFL back and re-raises, so the process still dies of
 * SIGTERM, just that much later. A handler the application installs before or after us
 * is never touched or wrapped (it decides; a normal exit then runs our atexit flush). */
static struct sigaction g_prev_term;
static pid_t g_term_pid;

static void on_sigterm(int sig) {
    int saved = errno;
    if (getpid() == g_term_pid && atomic_load(&g_sender_running)) {
        char c = 1;
        char drain[64];
        while (read(g_ack_pipe[0], drain, sizeof drain) > 0) {
        }
        if (write(g_wake_pipe[1], &c, 1) == 1) {
            struct pollfd p = {g_ack_pipe[0], POLLIN, 0};
            (void)poll(&p, 1, (int)cfg.stop_flush_ms + 100);
        }
    }
    sigaction(sig, &g_prev_term, NULL);
    errno = saved;
    raise(sig); /* blocked while we run: delivered, with the default action, on return */
}

void install_sigterm(void) {
    struct sigaction cur;
    if (!cfg.sigterm_flush || sigaction(SIGTERM, NULL, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) || cur.sa_handler != SIG_DFL) return; /* the application's own */
    if (g_wake_pipe[0] < 0 && make_pipe(g_wake_pipe)) return;
    if (g_ack_pipe[0] < 0 && make_pipe(g_ack_pipe)) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigterm;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    g_prev_term = cur;
    g_term_pid = getpid();
    sigaction(SIGTERM, &sa, NULL);
}

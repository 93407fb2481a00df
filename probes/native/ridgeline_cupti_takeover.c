/* Takeover by another CUPTI client on a legacy CUPTI: detected from our buffers, reported,
 * and CUPTI reclaimed when the other client is done.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* ------------------------------------------------------------------------------------ */
/* buffers handed to CUPTI, watched for a takeover                                       */
/*
 * On a legacy (single-subscriber) CUPTI the buffer callbacks are process-global: a later
 * cuptiActivityRegisterCallbacks by torch.profiler (Kineto) replaces ours, and CUPTI then
 * completes even the buffers we handed out to Kineto's callback, which drops ("unknown
 * buffer") and leaks them. Nothing tells us. What we can see, from our sender thread
 * right after our own cuptiActivityFlushAll(0): a buffer of ours into which CUPTI has
 * written records (its first record's kind is no longer the 0 we put there), which a
 * default flush should have returned, still not back after RL_TAKEOVER_TICKS flushes and
 * RL_TAKEOVER_MIN_MS. The peek never touches memory that may have been freed: it goes
 * through write(2) on a private pipe, which fails with EFAULT instead of faulting (an
 * unmapped buffer is itself proof that someone else completed and freed it).
 */
#define RL_TAKEOVER_TICKS 3
#define RL_TAKEOVER_MIN_MS 1000

int make_pipe(int p[2]) { return pipe2(p, O_CLOEXEC | O_NONBLOCK); }

static pthread_mutex_t g_cbuf_lock = PTHREAD_MUTEX_INITIALIZER;
cbuf_t *g_cbufs;
unsigned g_cbufs_cap;
int g_peek_pipe[2] = {-1, -1};
static uint64_t g_cbuf_seq;

void cbuf_add(uint8_t *b) {
    pthread_mutex_lock(&g_cbuf_lock);
    cbuf_t *freeslot = NULL, *oldest_lost = NULL;
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++) {
        if (!g_cbufs[i].buf) { freeslot = &g_cbufs[i]; break; }
        if (g_cbufs[i].lost && !oldest_lost) oldest_lost = &g_cbufs[i];
    }
    if (!freeslot) freeslot = oldest_lost; /* forget the oldest lost one */
    if (freeslot) *freeslot = (cbuf_t){b, 0, 0, 0, ++g_cbuf_seq};
    pthread_mutex_unlock(&g_cbuf_lock);
}

/* Returns -1 if b was counted lost (its outstanding count already released), 1 if it is
 * not a buffer we handed out (see buffer_done), else 0. */
int cbuf_remove(uint8_t *b) {
    int lost = 0, found = !g_cbufs; /* without the table (out of memory) every buffer is ours */
    pthread_mutex_lock(&g_cbuf_lock);
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++)
        if (g_cbufs[i].buf == b) {
            lost = g_cbufs[i].lost;
            found = 1;
            g_cbufs[i].buf = NULL;
            break;
        }
    pthread_mutex_unlock(&g_cbuf_lock);
    return !found ? 1 : lost ? -1 : 0;
}

int cbuf_known(uint8_t *b) {
    int found = !g_cbufs;
    pthread_mutex_lock(&g_cbuf_lock);
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap && !found; i++) found = g_cbufs[i].buf == b;
    pthread_mutex_unlock(&g_cbuf_lock);
    return found;
}

/* The kind of the first record in b, 0 if none yet, -1 if b is no longer mapped. */
static int peek_kind(const uint8_t *b) {
    int32_t kind = 0;
    if (g_peek_pipe[1] < 0) return 0;
    if (write(g_peek_pipe[1], b, sizeof kind) != (ssize_t)sizeof kind) return errno == EFAULT ? -1 : 0;
    if (read(g_peek_pipe[0], &kind, sizeof kind) != (ssize_t)sizeof kind) return 0;
    return kind;
}

/* Sender thread, right after cuptiActivityFlushAll(0) returned. */
void watch_takeover(uint64_t now) {
    unsigned lost = 0;
    int unmapped = 0;
    pthread_mutex_lock(&g_cbuf_lock);
    /* The newest buffer handed out is the one CUPTI is filling. A default flush does not
     * return a buffer holding an incomplete record (cupti_activity.h, cuptiActivityFlushAll:
     * "It doesn't return buffers which have one or more incomplete records"), and while
     * the GPU is busy that buffer always holds a kernel in flight: below a buffer's worth of
     * records a second it stays out for seconds with nothing wrong. Only a buffer CUPTI
     * has moved on from (it asked us for a newer one) can be overdue; the current one is
     * judged by an unmapped peek only. (A takeover that keeps the current buffer is
     * announced by Kineto's timestamp source, clock_tick, or seen exactly when preloaded.) */
    uint64_t newest = 0;
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++)
        if (g_cbufs[i].buf && !g_cbufs[i].lost && g_cbufs[i].seq > newest) newest = g_cbufs[i].seq;
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++) {
        cbuf_t *e = &g_cbufs[i];
        if (!e->buf || e->lost) continue;
        int k = peek_kind(e->buf);
        if (k < 0) unmapped = 1;
        if (k > 0 && e->seq == newest) {
            e->ticks = 0;
            e->written_since_ms = 0;
            continue;
        }
        if (k == 0) {
            e->ticks = 0;
            e->written_since_ms = 0;
            continue;
        }
        if (!e->written_since_ms) e->written_since_ms = now;
        if (k < 0 || (++e->ticks >= RL_TAKEOVER_TICKS && now - e->written_since_ms >= RL_TAKEOVER_MIN_MS)) {
            e->lost = 1;
            lost++;
        }
    }
    pthread_mutex_unlock(&g_cbuf_lock);
    if (lost) {
        atomic_fetch_sub(&g_outstanding_buffers, (int)lost);
        takeover_detected(lost, unmapped ? "a buffer of ours was freed by someone else"
                                         : "buffers CUPTI filled for us were not returned by our flushes");
    }
}

/* Sender thread: a takeover shown another way (the other client's timestamp source): every
 * buffer of ours still inside CUPTI will be completed to that client. */
unsigned cbufs_all_lost(void) {
    unsigned lost = 0;
    pthread_mutex_lock(&g_cbuf_lock);
    for (unsigned i = 0; g_cbufs && i < g_cbufs_cap; i++)
        if (g_cbufs[i].buf && !g_cbufs[i].lost) {
            g_cbufs[i].lost = 1;
            lost++;
        }
    pthread_mutex_unlock(&g_cbuf_lock);
    if (lost) atomic_fetch_sub(&g_outstanding_buffers, (int)lost);
    return lost;
}

/* ------------------------------------------------------------------------------------ */
/* takeover by another CUPTI client (legacy CUPTI) and getting CUPTI back                */

void takeover_detected(unsigned lost, const char *why) {
    atomic_fetch_add(&K.buffers_lost, lost);
    if (atomic_exchange(&g_taken_over, 1)) return;
    atomic_fetch_add(&K.takeovers, 1);
    atomic_fetch_or(&g_flags, RL_FLAG_TAKEN_OVER);
    rl_log("takeover: another CUPTI client (torch.profiler?) re-registered the activity buffer callbacks: %s "
           "(%u buffer(s) lost to it); Ridgeline records are paused until it is done", why, lost);
}

void takeover_false_alarm(void) {
    if (!atomic_exchange(&g_taken_over, 0)) return;
    atomic_fetch_and(&g_flags, ~(unsigned)RL_FLAG_TAKEN_OVER);
    rl_log("resumed: CUPTI still returns buffers to Ridgeline (a long-running record held one back): no takeover");
}

/* Sender thread: register our callbacks and kinds again (the other tool is done). Its
 * timestamp source, if it registered one, stays until CUPTI is finalized. */
void reclaim(const char *why) {
    CUptiResult r = C.RegisterCallbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        rl_log("reclaim failed: cuptiActivityRegisterCallbacks: %s (%d); still paused", cupti_err(r), (int)r);
        return;
    }
    if (cfg.graph_level) (void)kind_set(CUPTI_ACTIVITY_KIND_GRAPH_TRACE, 1);
    apply_mode(atomic_load(&g_mode), 1);
    atomic_fetch_add(&K.reclaims, 1);
    atomic_store(&g_taken_over, 0);
    atomic_fetch_and(&g_flags, ~(unsigned)RL_FLAG_TAKEN_OVER);
    rl_log("resumed: %s; Ridgeline's buffer callbacks and activity kinds are registered again", why);
}

/* 1 when CUPTI says no client has kernel records enabled any more (CUPTI >= 13.2). */
int kernels_disabled_everywhere(void) {
    if (!C.GetEnabledKinds) return 0;
    CUpti_ActivityKind kinds[256]; /* the size argument is a count; room for it as bytes too */
    uint32_t cap = 64, n = 0;
    if (C.GetEnabledKinds(NULL, kinds, &cap, &n) != CUPTI_SUCCESS) return 0;
    for (uint32_t i = 0; i < n && i < 64; i++)
        if (kinds[i] == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || kinds[i] == CUPTI_ACTIVITY_KIND_KERNEL) return 0;
    return 1;
}

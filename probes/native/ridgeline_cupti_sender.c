/* The sender thread: the agent's unix socket (non-blocking connect, send, control messages),
 * periodic flushes, and starting the thread.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

int collecting(void) {
    return C.FlushAll && !g_test_mode && !(atomic_load(&g_flags) & (RL_FLAG_CONFLICT | RL_FLAG_NO_CUPTI));
}

/* Every flush period, on the sender thread (never in a CUPTI callback): deliver what
 * CUPTI has completed so a quiet process's records arrive within a period instead of
 * when a buffer fills, then look for a takeover, or for its end. */
static void sender_tick(uint64_t now) {
    if (!collecting()) return;
    /* the other client finalized CUPTI (seen exactly when preloaded): ours again */
    if (atomic_exchange(&g_cupti_finalized, 0)) reclaim("the other CUPTI client finalized CUPTI");
    CUptiResult r = C.FlushAll(0);
    atomic_fetch_add(&K.flushes, 1);
    clock_tick();
    if (g_multi) return; /* per-subscriber callbacks: nobody can take ours */
    if (!atomic_load(&g_taken_over)) {
        watch_takeover(now);
        return;
    }
    if (atomic_exchange(&g_reclaim_req, 0)) reclaim("the agent asked to reclaim CUPTI");
    else if (r == CUPTI_ERROR_NOT_INITIALIZED || r == CUPTI_ERROR_INVALID_OPERATION)
        reclaim("the other tool finalized CUPTI");
    else if (kernels_disabled_everywhere())
        reclaim("the other tool disabled its activity kinds (it stopped)");
}

/* Retry delays after a connect found the agent's backlog full (EAGAIN): the agent is there
 * but a connect flood (any local user can make one) holds its queue, so come back soon, not
 * after RIDGELINE_RECONNECT_MS (1 s; no agent at all) -- at most one attempt a 250 ms. */
#define RL_BUSY_RETRY_MIN_MS 10u
#define RL_BUSY_RETRY_MAX_MS 250u

/* A connected socket, or -1; *busy set when the agent's backlog was full (EAGAIN). */
static int connect_agent(int *busy) {
    *busy = 0;
    if (!cfg.socket_path[0]) return -1; /* refused at start-up (logged) */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    memcpy(a.sun_path, cfg.socket_path, strlen(cfg.socket_path));
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        /* EAGAIN (backlog full) and EINPROGRESS are treated as "not now": retry later */
        *busy = errno == EAGAIN || errno == EWOULDBLOCK;
        close(fd);
        return -1;
    }
    return fd;
}

static void handle_control(const uint8_t *body, uint32_t len) {
    if (len < sizeof(rl_control_t)) return;
    rl_control_t c;
    memcpy(&c, body, sizeof c);
    if (c.kernel_sample_every) atomic_store(&g_sample_every, c.kernel_sample_every > 1000000 ? 1000000 : c.kernel_sample_every);
    if ((c.mode == RL_MODE_ALWAYS_ON || c.mode == RL_MODE_DEEP) && (int)c.mode != atomic_load(&g_mode))
        apply_mode((int)c.mode, 0);
    if ((c.flags & RL_CONTROL_RECLAIM) && atomic_load(&g_taken_over)) atomic_store(&g_reclaim_req, 1);
}

/* Reads whatever control bytes are there; returns -1 when the agent closed. */
static int read_control(int fd, uint8_t *in, size_t *in_len, size_t in_cap) {
    for (;;) {
        ssize_t r = recv(fd, in + *in_len, in_cap - *in_len, MSG_DONTWAIT);
        if (r == 0) return -1;
        if (r < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
        *in_len += (size_t)r;
        for (;;) {
            if (*in_len < sizeof(rl_frame_t)) break;
            rl_frame_t f;
            memcpy(&f, in, sizeof f);
            if (f.magic != RL_MAGIC || f.length > in_cap - sizeof f) return -1; /* not our agent */
            if (*in_len < sizeof f + f.length) break;
            if (f.type == RL_MSG_CONTROL) handle_control(in + sizeof f, f.length);
            memmove(in, in + sizeof f + f.length, *in_len - sizeof f - f.length);
            *in_len -= sizeof f + f.length;
        }
        if (*in_len == in_cap) return -1;
    }
}

static void *sender_main(void *arg) {
    (void)arg;
    int fd = -1;
    uint64_t next_connect = 0;
    unsigned busy_ms = 0; /* the current retry delay while the agent's backlog is full */
    outmsg_t msg = {0};
    int pending = 0;
    uint8_t in[256];
    size_t in_len = 0;
    unsigned hello_gen = 0;
    uint64_t next_tick = now_ms() + cfg.flush_ms, drain_until = 0;
    while (!atomic_load(&g_stop)) {
        uint64_t now = now_ms();
        char wake;
        if (g_wake_pipe[0] >= 0 && read(g_wake_pipe[0], &wake, 1) == 1) {
            /* the process is being told to stop (SIGTERM): flush and ship now */
            if (collecting()) (void)C.FlushAll(0);
            drain_until = now + cfg.stop_flush_ms;
        } else if (cfg.flush_ms && now >= next_tick) {
            sender_tick(now);
            next_tick = now + cfg.flush_ms;
        }
        if (fd < 0 && now >= next_connect) {
            int busy;
            fd = connect_agent(&busy);
            if (busy) {
                atomic_fetch_add(&K.connects_busy, 1);
                busy_ms = busy_ms ? 2 * busy_ms : RL_BUSY_RETRY_MIN_MS;
                if (busy_ms > RL_BUSY_RETRY_MAX_MS) busy_ms = RL_BUSY_RETRY_MAX_MS;
                next_connect = now + (busy_ms < cfg.reconnect_ms ? busy_ms : cfg.reconnect_ms);
            } else {
                busy_ms = 0;
                next_connect = now + cfg.reconnect_ms;
            }
            if (fd >= 0) {
                atomic_fetch_add(&K.connects, 1);
                g_names_sent = 0;
                in_len = 0;
                hello_gen = atomic_load(&g_status_gen);
                build_hello(&msg);
                msg.started_ms = msg.progress_ms = now;
                pending = 1;
            }
        }
        if (!pending && fd >= 0 && atomic_load(&g_status_gen) != hello_gen) {
            /* flags or status changed (takeover, reclaim): tell the agent now */
            hello_gen = atomic_load(&g_status_gen);
            build_hello(&msg);
            msg.started_ms = msg.progress_ms = now_ms();
            pending = 1;
        }
        if (drain_until) {
            int idle = !pending;
            pthread_mutex_lock(&g_pool_lock);
            for (unsigned i = 0; idle && i < cfg.pool_slots; i++) idle = g_slots[i].state == SLOT_FREE;
            pthread_mutex_unlock(&g_pool_lock);
            if (idle || now_ms() >= drain_until) {
                drain_until = 0;
                ssize_t w = write(g_ack_pipe[1], "k", 1);
                (void)w;
            }
        }
        if (!pending) {
            /* take the oldest ready slot */
            slot_t *s = NULL;
            pthread_mutex_lock(&g_pool_lock);
            for (unsigned i = 0; i < cfg.pool_slots; i++)
                if (g_slots[i].state == SLOT_READY && (!s || g_slots[i].seq < s->seq)) s = &g_slots[i];
            if (!s) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 50 * 1000000L;
                if (ts.tv_nsec >= 1000000000L) {
                    ts.tv_sec++;
                    ts.tv_nsec -= 1000000000L;
                }
                pthread_cond_timedwait(&g_pool_cond, &g_pool_lock, &ts);
            }
            pthread_mutex_unlock(&g_pool_lock);
            if (s) {
                if (fd < 0) {
                    atomic_fetch_add(&K.dropped_no_agent, s->records);
                } else if (build_batch(&msg, s) == 0) {
                    msg.started_ms = msg.progress_ms = now_ms();
                    pending = 1;
                    atomic_store(&g_send_pending, 1); /* before the slot shows free */
                } else {
                    atomic_fetch_add(&K.dropped_send, s->records); /* out of memory for the message */
                }
                pthread_mutex_lock(&g_pool_lock);
                s->state = SLOT_FREE;
                pthread_mutex_unlock(&g_pool_lock);
            }
        }
        if (fd >= 0 && pending) {
            ssize_t w = send(fd, msg.buf + msg.sent, msg.len - msg.sent, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (w > 0) {
                msg.sent += (size_t)w;
                msg.progress_ms = now_ms();
                if (msg.sent == msg.len) {
                    pending = 0;
                    if (msg.records) {
                        atomic_fetch_add(&K.records_sent, msg.records);
                        atomic_fetch_add(&K.batches_sent, 1);
                    }
                }
            } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                atomic_fetch_add(&K.dropped_send, msg.records);
                pending = 0;
                close(fd);
                fd = -1;
            } else if (now_ms() - msg.progress_ms > cfg.stall_ms) {
                /* agent accepts nothing: give up on it; the next connection starts clean */
                atomic_fetch_add(&K.dropped_send, msg.records);
                pending = 0;
                close(fd);
                fd = -1;
            }
        }
        if (fd >= 0 && read_control(fd, in, &in_len, sizeof in) < 0) {
            if (pending) atomic_fetch_add(&K.dropped_send, msg.records);
            pending = 0;
            close(fd);
            fd = -1;
        }
        if (fd >= 0 && pending && msg.sent < msg.len) {
            struct pollfd pfd = {fd, POLLOUT | POLLIN, 0};
            (void)poll(&pfd, 1, 20);
        } else if (fd < 0 && pending) {
            pending = 0;
        }
        atomic_store(&g_send_pending, pending);
    }
    atomic_store(&g_send_pending, 0);
    if (fd >= 0) close(fd);
    free(msg.buf);
    return NULL;
}

pthread_mutex_t g_start_lock = PTHREAD_MUTEX_INITIALIZER;

void start_sender_if_needed(void) {
    if (atomic_load(&g_sender_running) || !atomic_load(&g_active) || atomic_load(&g_exiting)) return;
    pthread_mutex_lock(&g_start_lock);
    if (!atomic_load(&g_sender_running) && !atomic_load(&g_exiting)) {
        atomic_store(&g_stop, 0);
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setstacksize(&at, 256 << 10);
        /* Block every signal in our thread: the application's handlers must run on its own threads. */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        if (pthread_create(&g_sender, &at, sender_main, NULL) == 0) atomic_store(&g_sender_running, 1);
        else rl_log("cannot start the sender thread; records will be dropped");
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&at);
    }
    pthread_mutex_unlock(&g_start_lock);
}

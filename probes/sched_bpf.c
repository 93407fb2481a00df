/* Ridgeline scheduling probe (bcc). Loaded by probes/sched.py, which passes:
 *   TS_PID, TS_TGID   task_struct member offsets from the running kernel's BTF
 *                     (never from the kernel headers: on VM kernels they are another version)
 *   TARGET_WORDS      size of the target bitmap in u64 words (pid_max / 64, rounded up)
 *   MAX_THREADS       most threads tracked at once (beyond: C_THREADS_LOST)
 *   SLOT_BITS         log2 of the slot table size (at least 4 * MAX_THREADS slots)
 *   RB_PAGES          ring-buffer pages (exit, fork and slow-run-queue events)
 *
 * Raw tracepoints: sched_switch(bool preempt, prev, next, unsigned prev_state),
 * sched_wakeup(p), sched_wakeup_new(p), sched_process_exit(p, group_dead); layouts are
 * checked against BTF before loading. Per-thread entries live in a slot table keyed by the
 * task_struct pointer, which the raw arguments carry: slot i holds the pointer of its thread
 * in `slot_task` (0: free) and its totals in `threads[i]`. Slots come in buckets of WAYS; a
 * pointer may sit in either of two buckets (two multiplicative hashes), so a lookup compares
 * at most 2 x WAYS words and a free slot is simply 0 again (no tombstones, no chains that
 * grow with thread turnover). Both are arrays, whose lookups the verifier inlines: a BPF hash
 * lookup costs a function call and jhash (~35 ns here against ~10 ns, docs/benchmarks-ebpf.md).
 * So an event for a task that is not tracked costs one inlined array probe and no kernel
 * memory read. Targets are a bitmap indexed by tgid (an array lookup). tid/tgid are read from
 * task_struct (BTF offsets) only when a thread is first met outside its own context (a new
 * thread, or while `discover` is on after a target was added).
 *
 * Per thread the value holds cumulative totals that are never cleared in the kernel: user
 * space reads both arrays through mmap (BPF_F_MMAPABLE) once per window and takes differences
 * (the read-and-clear is done by differencing, which costs the hot path nothing). A slot's
 * tid is 0 while it is being filled (written last when a thread is tracked; user space skips
 * rows with tid 0) and is cleared once it is freed, by the side whose compare-and-swap of
 * `slot_task` freed it (release()). A thread's last totals go to the ring buffer when it
 * exits, then its slot is freed. `live` counts claims and frees: user space frees the slots
 * of removed targets and of threads gone unseen with the same compare-and-swap
 * (probes/sched_native), and alone writes L_FREED_USER, counting only the frees its swap
 * made; so each claim is freed and counted once, and at most MAX_THREADS threads are
 * tracked at once.
 */
#include <uapi/linux/ptrace.h>

#define S_UNKNOWN  0
#define S_ONCPU    1
#define S_RUNNABLE 2
#define S_BLOCKED  3

#define EV_EXIT      1
#define EV_FORK      2
#define EV_SLOW_RUNQ 3

#define TASK_DEAD_STATE 0x80
#define RQ_SLOTS 32

#define CFG_SLOW_RUNQ_NS 0   /* emit EV_SLOW_RUNQ for run-queue waits >= this (0 = off) */
#define CFG_FOLLOW_FORKS 1   /* adopt child processes of targets */
#define CFG_DISCOVER     2   /* read tgid of unknown tasks at switch-in/wakeup */
#define CFG_RB_FLAGS     3   /* ring-buffer output flags (BPF_RB_NO_WAKEUP = 1) */

#define C_EVENTS_LOST    0   /* ring buffer full */
#define C_THREADS_LOST   1   /* per-thread map full */
#define C_GAPS           2   /* transitions whose preceding event was never seen */
#define C_EVENTS         3   /* events emitted to the ring buffer */

struct thread_t {
    u32 ev_type;         /* EV_EXIT when sent to the ring buffer */
    u32 tid;
    u32 tgid;
    u32 cpu;             /* cpu of the last switch-in */
    u64 ts;              /* time of the last transition (CLOCK_MONOTONIC ns) */
    u64 oncpu_ns;
    u64 runq_ns;         /* runnable, not running (after a wakeup or a preemption) */
    u64 runq_preempt_ns; /* the part of runq_ns that followed an involuntary switch */
    u64 blocked_ns;      /* voluntary switch-out -> wakeup */
    u64 unattributed_ns; /* interval whose opening event was never seen */
    u64 runq_max_ns;
    u64 nvcsw;
    u64 nivcsw;
    u64 migrations;
    u64 wakeups;
    u64 slices;
    u64 gaps;
    u8  state;
    u8  preempted;       /* runnable because preempted (not woken) */
    u8  exiting;
    u8  pad[5];
    char comm[16];
    u32 hist[RQ_SLOTS];  /* run-queue wait, bcc log2 slots of microseconds */
};

struct ev_t {            /* EV_FORK, EV_SLOW_RUNQ */
    u32 ev_type;
    u32 tid;
    u32 tgid;
    u32 cpu;
    u64 ts;
    u64 value;           /* EV_SLOW_RUNQ: wait ns; EV_FORK: parent tgid */
};

#define NSLOTS (1 << SLOT_BITS)
#define WAYS 4
#define BUCKET_BITS (SLOT_BITS - 2)
#define HASH1 0x9E3779B97F4A7C15ULL
#define HASH2 0xC2B2AE3D27D4EB4FULL
#define L_CLAIMED    0
#define L_FREED_BPF  1
#define L_FREED_USER 2

BPF_ARRAY(targets, u64, TARGET_WORDS);
struct bucket_t { u64 task[WAYS]; };
BPF_F_TABLE("array", int, struct bucket_t, slot_task, NSLOTS / WAYS, BPF_F_MMAPABLE);
BPF_F_TABLE("array", int, struct thread_t, threads, NSLOTS, BPF_F_MMAPABLE);
BPF_ARRAY(live, u64, 3);
BPF_ARRAY(config, u64, 4);
BPF_PERCPU_ARRAY(counters, u64, 4);
BPF_RINGBUF_OUTPUT(events, RB_PAGES);

static __always_inline u64 cfg(int i) {
    u64 *v = config.lookup(&i);
    return v ? *v : 0;
}

static __always_inline void bump(int i) {
    u64 *c = counters.lookup(&i);
    if (c)
        (*c)++;
}

static __always_inline int is_target(u32 tgid) {
    int w = tgid >> 6;
    u64 *bits = targets.lookup(&w);
    return bits && (*bits & (1ULL << (tgid & 63)));
}

static __always_inline u32 rd32(u64 task, int off) {
    u32 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)(task + off));
    return v;
}

static __always_inline void emit_ev(u32 type, u32 tid, u32 tgid, u64 ts, u64 value) {
    struct ev_t ev = {};
    ev.ev_type = type; ev.tid = tid; ev.tgid = tgid;
    ev.cpu = bpf_get_smp_processor_id(); ev.ts = ts; ev.value = value;
    if (events.ringbuf_output(&ev, sizeof(ev), cfg(CFG_RB_FLAGS)) == 0)
        bump(C_EVENTS);
    else
        bump(C_EVENTS_LOST);
}

static __always_inline int bucket(u64 task, u64 mul) {
    return (int)((task * mul) >> (64 - BUCKET_BITS));
}

/* The slot of a tracked task, or -1. */
static __always_inline int find(u64 task) {
    #pragma unroll
    for (int c = 0; c < 2; c++) {
        int b = bucket(task, c ? HASH2 : HASH1);
        struct bucket_t *k = slot_task.lookup(&b);
        if (!k)
            return -1;
        #pragma unroll
        for (int w = 0; w < WAYS; w++)
            if (k->task[w] == task)
                return b * WAYS + w;
    }
    return -1;
}

static __always_inline void live_add(int i) {
    u64 *c = live.lookup(&i);
    if (c)
        __sync_fetch_and_add(c, 1);
}

static __always_inline u64 live_count(void) {
    int a = L_CLAIMED, b = L_FREED_BPF, c = L_FREED_USER;
    u64 *claimed = live.lookup(&a), *freed = live.lookup(&b), *freed_user = live.lookup(&c);
    if (!claimed || !freed || !freed_user)
        return 0;
    /* Signed, clamped. Every claim and every free is counted exactly once (each side
       counts only the frees its own compare-and-swap made), so the counters no longer drift;
       the clamp stays for the read itself: the three counters are loaded one after the other
       while other CPUs claim and free, so `claimed` can be loaded before a claim whose free
       is in the `freed` loaded next (an empty table that one thread enters and leaves
       meanwhile reads -1). Unclamped, that transient -1 is 2^64 - 1 and refuses this thread. */
    s64 n = (s64)(*claimed - *freed - *freed_user);
    return n > 0 ? (u64)n : 0;
}

/* Free the slot of a task (exited, or a dead task's entry at a reused address).
   The slot is freed, and counted, only by a compare-and-swap of its task pointer, as user space
   frees it (probes/sched_native): where that fails, user space freed it first (and counted it),
   and the slot may already hold a new thread, whose row this is now: nothing of it is touched.
   The tid is cleared only after the swap succeeded, and by a compare-and-swap of the row's
   first word (ev_type, tid: bcc's BPF target has no 32-bit atomics) against the word read
   before the free: a thread that claims the slot between the two rewrites that word (tid 0,
   then its own), and keeps its tid. Readers lose nothing by the later clear: a row copied
   after the free is dropped by _read's second look at `slot_task` (0 now, or the new owner),
   unless a new task at the same address took the same slot before that look; the copy is then
   the freed thread's last row (for an exit, the one its exit record carries: the window takes
   the exit record's instead). */
static __always_inline void release(u64 task, int idx, struct thread_t *s) {
    int b = (u32)idx / WAYS;
    struct bucket_t *k = slot_task.lookup(&b);
    if (!k)
        return;
    u64 *head = (u64 *)s;                /* ev_type | tid << 32 */
    u64 w = *head;                       /* this task's row if the swap below succeeds */
    asm volatile("" ::: "memory");
    if (__sync_val_compare_and_swap(&k->task[idx & (WAYS - 1)], task, 0) != task)
        return;
    live_add(L_FREED_BPF);
    __sync_val_compare_and_swap(head, w, w & 0xffffffffULL);
}

/* Create the entry of a thread first met now; returns it or NULL (MAX_THREADS tracked, or the
   2 x WAYS slots of its two buckets all taken: C_THREADS_LOST). */
static __always_inline struct thread_t *track(u64 task, u32 tid, u32 tgid, u8 state, u64 now, int current) {
    if (live_count() >= MAX_THREADS) {
        bump(C_THREADS_LOST);
        return 0;
    }
    int idx = -1;
    #pragma unroll
    for (int c = 0; c < 2; c++) {
        int b = bucket(task, c ? HASH2 : HASH1);
        struct bucket_t *k = slot_task.lookup(&b);
        if (!k)
            break;
        #pragma unroll
        for (int w = 0; w < WAYS; w++) {
            if (idx < 0 && k->task[w] == 0 && __sync_val_compare_and_swap(&k->task[w], 0, task) == 0)
                idx = b * WAYS + w;
        }
        if (idx >= 0)
            break;
    }
    struct thread_t *s = threads.lookup(&idx);
    if (!s) {
        bump(C_THREADS_LOST);
        return 0;
    }
    live_add(L_CLAIMED);
    struct thread_t t = {};             /* tid stays 0 until the rest is written */
    t.tgid = tgid; t.state = state; t.ts = now;
    t.cpu = bpf_get_smp_processor_id();
    if (current)
        bpf_get_current_comm(&t.comm, sizeof(t.comm));
    *s = t;
    asm volatile("" ::: "memory");
    s->tid = tid;
    return s;
}

/* RQ_SLOT_BEGIN: the histogram slot of a run-queue wait of d ns, equal to bcc's
   bpf_log2l(d / 1000) clamped to RQ_SLOTS - 1 (slot k >= 1 holds 1000 * 2^(k-1) <= d < 1000 * 2^k,
   waits under 2 us in slot 1), by five compares instead of a 64-bit division (~10 ns per
   switch-in here). tests/test_sched_slot.py checks it against bcc's own bpf_log2l. */
static __always_inline unsigned int rq_slot(unsigned long long d) {
    unsigned int s = 0;
    if (d >= (1000ULL << (s + 15))) s += 16;
    if (d >= (1000ULL << (s + 7))) s += 8;
    if (d >= (1000ULL << (s + 3))) s += 4;
    if (d >= (1000ULL << (s + 1))) s += 2;
    if (d >= (1000ULL << s)) s += 1;
    return s ? s : 1;
}
/* RQ_SLOT_END */

static __always_inline void switch_in(struct thread_t *s, u64 now) {
    if (s->state == S_RUNNABLE) {
        u64 d = now - s->ts;
        s->runq_ns += d;
        if (s->preempted)
            s->runq_preempt_ns += d;
        if (d > s->runq_max_ns)
            s->runq_max_ns = d;
        u32 slot = rq_slot(d);
        if (slot >= RQ_SLOTS)            /* never (rq_slot <= 31); the verifier's bound */
            slot = RQ_SLOTS - 1;
        s->hist[slot]++;
        u64 thr = cfg(CFG_SLOW_RUNQ_NS);
        if (thr && d >= thr)
            emit_ev(EV_SLOW_RUNQ, s->tid, s->tgid, now, d);
    } else if (s->state == S_BLOCKED || s->state == S_ONCPU) {
        /* the wakeup (or our own switch-out) was not observed: keep the interval, don't guess its split */
        s->unattributed_ns += now - s->ts;
        s->gaps++;
        bump(C_GAPS);
    }
    u32 cpu = bpf_get_smp_processor_id();
    if (s->slices && cpu != s->cpu)
        s->migrations++;
    s->cpu = cpu;
    s->slices++;
    s->state = S_ONCPU;
    s->ts = now;
}

RAW_TRACEPOINT_PROBE(sched_switch) {
    /* TP_PROTO(bool preempt, struct task_struct *prev, struct task_struct *next, unsigned int prev_state) */
    u64 prev = ctx->args[1], next = ctx->args[2];
    u64 now = 0;
    /* current == prev here. Its tgid through the BTF task pointer: two loads, where
       bpf_get_current_pid_tgid() is a helper call (about 15 ns here, docs/benchmarks-ebpf.md) */
    char *cur = (char *)bpf_get_current_task_btf();
    u32 tgid = *(u32 *)(cur + TS_TGID);

    /* ---- prev: switching out (always in its own context, so never hidden) ---- */
    if (tgid && is_target(tgid)) {
        now = bpf_ktime_get_ns();
        u32 tid = *(u32 *)(cur + TS_PID);
        unsigned int pstate = (unsigned int)ctx->args[3];
        /* The kernel's rule for nivcsw: preempted, or still TASK_RUNNING (yield, a wakeup
           that raced the block). Everything else is a voluntary switch. */
        int involuntary = ((int)ctx->args[0] & 1) || pstate == 0;
        int idx = find(prev);
        struct thread_t *s = threads.lookup(&idx);
        if (s && s->tid != tid) {            /* stale entry of a dead task at a reused address */
            release(prev, idx, s);
            s = 0;
        }
        if (!s) {
            s = track(prev, tid, tgid, S_UNKNOWN, now, 1);
            idx = find(prev);
        }
        if (s) {
            if (s->state == S_ONCPU) {
                s->oncpu_ns += now - s->ts;
            } else if (s->state != S_UNKNOWN) {
                s->unattributed_ns += now - s->ts;   /* switch-in not observed */
                s->gaps++;
                bump(C_GAPS);
            }
            if (involuntary) {
                s->nivcsw++;
                s->state = S_RUNNABLE;
                s->preempted = 1;
            } else {
                s->nvcsw++;
                s->state = S_BLOCKED;
            }
            s->ts = now;
            if ((s->slices & 63) == 1)           /* thread names change (pthread_setname_np) */
                bpf_get_current_comm(&s->comm, sizeof(s->comm));
            if (pstate & TASK_DEAD_STATE) {      /* the last switch of an exiting thread */
                s->ev_type = EV_EXIT;
                if (events.ringbuf_output(s, sizeof(*s), 0) == 0)
                    bump(C_EVENTS);
                else
                    bump(C_EVENTS_LOST);
                release(prev, idx, s);
            }
        }
    }

    /* ---- next: switching in ---- */
    int nidx = find(next);
    struct thread_t *n = threads.lookup(&nidx);
    if (!n && cfg(CFG_DISCOVER)) {
        u32 ntgid = rd32(next, TS_TGID);
        if (ntgid && is_target(ntgid)) {
            if (!now)
                now = bpf_ktime_get_ns();
            /* first seen switching in: its wait before this is unknown */
            n = track(next, rd32(next, TS_PID), ntgid, S_UNKNOWN, now, 0);
        }
    }
    if (n) {
        if (!now)
            now = bpf_ktime_get_ns();
        switch_in(n, now);
    }
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_wakeup) {
    u64 p = ctx->args[0];
    u64 now;
    int idx = find(p);
    struct thread_t *s = threads.lookup(&idx);
    /* The clock is read only once the wakeup is known to be a transition of a tracked thread:
       it is the most expensive step of the program (bpf_ktime_get_ns, ~65 ns here). */
    if (!s) {
        if (!cfg(CFG_DISCOVER))
            return 0;
        u32 tgid = rd32(p, TS_TGID);
        if (!tgid || !is_target(tgid))
            return 0;
        now = bpf_ktime_get_ns();
        s = track(p, rd32(p, TS_PID), tgid, S_UNKNOWN, now, 0);
        if (!s)
            return 0;
    } else if (s->state == S_BLOCKED) {
        now = bpf_ktime_get_ns();
        s->blocked_ns += now - s->ts;
        s->wakeups++;
    } else if (s->state == S_UNKNOWN) {
        now = bpf_ktime_get_ns();
    } else {
        return 0;   /* on CPU or already queued (ttwu_runnable): not a transition */
    }
    s->state = S_RUNNABLE;
    s->preempted = 0;
    s->ts = now;
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_wakeup_new) {
    u64 p = ctx->args[0];
    u32 ptgid = bpf_get_current_pid_tgid() >> 32;     /* runs in the parent */
    if (!is_target(ptgid))
        return 0;
    u32 tgid = rd32(p, TS_TGID);
    u32 tid = rd32(p, TS_PID);
    u64 now = bpf_ktime_get_ns();
    if (tgid != ptgid && !is_target(tgid)) {
        if (!cfg(CFG_FOLLOW_FORKS))
            return 0;
        /* a child process: a target from now on (user space learns it from the event) */
        int w = tgid >> 6;
        u64 *bits = targets.lookup(&w);
        if (bits)
            __sync_fetch_and_or(bits, 1ULL << (tgid & 63));
        emit_ev(EV_FORK, tid, tgid, now, ptgid);
    }
    /* A slot still held for a dead task at this address (its exit unseen) goes first: the
       hash map's update replaced such an entry, and two slots must never hold one task. */
    int old = find(p);
    struct thread_t *stale = threads.lookup(&old);
    if (stale)
        release(p, old, stale);
    struct thread_t *s = track(p, tid, tgid, S_RUNNABLE, now, 0);
    if (s)
        bpf_get_current_comm(&s->comm, sizeof(s->comm));   /* inherits the parent's name until it sets its own */
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_process_exit) {
    /* TP_PROTO(struct task_struct *p, bool group_dead) (6.18; older kernels: (p)). Runs in p. */
    u64 p = ctx->args[0];
    int idx = find(p);
    struct thread_t *s = threads.lookup(&idx);
    if (s) {
        s->exiting = 1;
        bpf_get_current_comm(&s->comm, sizeof(s->comm));
    }
    return 0;
}

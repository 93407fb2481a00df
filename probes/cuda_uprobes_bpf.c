/* Ridgeline CUDA uprobes (bcc). Loaded by probes/cuda_uprobes.py, which attaches these
 * handlers once per library file (inode) that a target process maps (libcudart / libcuda), by
 * plain symbol name (see the symbol tables there), for every process; the handlers keep only
 * the target processes (a tgid bitmap). Attaching per library rather than per process means a
 * new process using the same library is covered at once, and an exit costs no detach (closing
 * a uprobe takes ~80 ms in the kernel here). MAX_THREADS: capacity of the per-thread map;
 * TARGET_WORDS: bitmap size in u64 words.
 *
 * Per thread, cumulative counters (user space differences them per window): kernel
 * launches, graph launches, copies and bytes by direction, synchronisation calls and the
 * time spent blocked in them (return probes), time blocked in synchronous copies.
 *
 * The runtime (libcudart) calls into the driver (libcuda). For a process that maps both
 * (its bit set in `cnest`), every runtime function also has a return probe, and a
 * per-thread depth counts driver calls made inside a runtime call as `nested` instead of
 * counting them twice.
 */
#include <uapi/linux/ptrace.h>

#define K_NONE 0
#define K_SYNC 1
#define K_COPY 2
#define K_LAUNCH 3

/* copy directions: index into bytes[] */
#define D_HTOH 0
#define D_HTOD 1
#define D_DTOH 2
#define D_DTOD 3
#define D_PEER 4
#define D_OTHER 5

struct cstat_t {
    u32 tgid;
    u32 depth;           /* inside a runtime call (nesting mode only) */
    u64 rt_ts;           /* entry time of the pending runtime call with a return probe */
    u64 drv_ts;          /* same, driver layer */
    u8  rt_kind;
    u8  drv_kind;
    u8  pad[6];
    u64 launches;
    u64 graph_launches;
    u64 copies;
    u64 bytes[6];
    u64 sync_calls;
    u64 sync_ns;         /* time blocked in stream/device/event synchronisation */
    u64 copy_wait_ns;    /* time blocked in synchronous copies */
    u64 launch_call_ns;  /* time inside launch calls (launch-latency mode only) */
    u64 nested;          /* driver calls made by the runtime (not counted again) */
};

BPF_HASH(cstats, u32, struct cstat_t, MAX_THREADS);
BPF_PERCPU_ARRAY(ccounters, u64, 2);   /* [0] threads lost (map full) */
BPF_ARRAY(ctargets, u64, TARGET_WORDS);
BPF_ARRAY(cnest, u64, TARGET_WORDS);

static __always_inline int bit(u64 *bits, u32 tgid) {
    return bits && (*bits & (1ULL << (tgid & 63)));
}

static __always_inline struct cstat_t *get(void) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    int w = (id >> 32) >> 6;
    if (!bit(ctargets.lookup(&w), id >> 32))
        return 0;
    struct cstat_t *s = cstats.lookup(&tid);
    if (s)
        return s;
    struct cstat_t z = {};
    z.tgid = id >> 32;
    s = cstats.lookup_or_try_init(&tid, &z);
    if (!s) {
        int k = 0;
        u64 *c = ccounters.lookup(&k);
        if (c)
            (*c)++;
    }
    return s;
}

static __always_inline u32 rt_dir(u64 arg) {
    /* enum cudaMemcpyKind: 0 HtoH, 1 HtoD, 2 DtoH, 3 DtoD, 4 Default (inferred from pointers).
       An int argument fills only the low 32 bits of its register or stack slot. */
    u32 kind = (u32)arg;
    if (kind <= 3)
        return kind;
    return D_OTHER;
}

static __always_inline void add_copy(struct cstat_t *s, u32 dir, u64 n) {
    s->copies++;
    /* explicit branches: the verifier rejects a computed index the compiler may not bound */
    switch (dir) {
    case D_HTOH: s->bytes[D_HTOH] += n; break;
    case D_HTOD: s->bytes[D_HTOD] += n; break;
    case D_DTOH: s->bytes[D_DTOH] += n; break;
    case D_DTOD: s->bytes[D_DTOD] += n; break;
    case D_PEER: s->bytes[D_PEER] += n; break;
    default:     s->bytes[D_OTHER] += n; break;
    }
}

static __always_inline void rt_pending(struct cstat_t *s, u8 kind) {
    s->rt_ts = bpf_ktime_get_ns();
    s->rt_kind = kind;
}

static __always_inline void drv_pending(struct cstat_t *s, u8 kind) {
    s->drv_ts = bpf_ktime_get_ns();
    s->drv_kind = kind;
}

static __always_inline void account_return(struct cstat_t *s, u8 kind, u64 ts) {
    if (!ts)
        return;
    u64 d = bpf_ktime_get_ns() - ts;
    if (kind == K_SYNC)
        s->sync_ns += d;
    else if (kind == K_COPY)
        s->copy_wait_ns += d;
    else if (kind == K_LAUNCH)
        s->launch_call_ns += d;
}

/* ------------------------------------------------------------ runtime API (libcudart) */
static __always_inline struct cstat_t *rt_get(void) {
    struct cstat_t *s = get();
    if (s) {
        int w = s->tgid >> 6;
        if (bit(cnest.lookup(&w), s->tgid) && s->depth < 16)
            s->depth++;     /* balanced by rt_return, attached to every runtime function */
    }
    return s;
}
int rt_launch(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) s->launches++;
    return 0;
}

int rt_launch_timed(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) { s->launches++; rt_pending(s, K_LAUNCH); }
    return 0;
}

int rt_graph(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) s->graph_launches++;
    return 0;
}

/* cudaMemcpy(dst, src, count, kind) and the Async/_ptds/_ptsz forms */
int rt_memcpy(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) add_copy(s, rt_dir(PT_REGS_PARM4(ctx)), PT_REGS_PARM3(ctx));
    return 0;
}

int rt_memcpy_sync(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) { add_copy(s, rt_dir(PT_REGS_PARM4(ctx)), PT_REGS_PARM3(ctx)); rt_pending(s, K_COPY); }
    return 0;
}

/* cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind[, stream]): kind is the 7th argument */
static __always_inline u64 arg7(struct pt_regs *ctx) {
    u64 v = 0;
#ifdef __x86_64__
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8));   /* [rsp] is the return address */
#else
    v = ctx->regs[6];
#endif
    return v;
}

int rt_memcpy2d(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) add_copy(s, rt_dir(arg7(ctx)), PT_REGS_PARM5(ctx) * PT_REGS_PARM6(ctx));
    return 0;
}

int rt_memcpy2d_sync(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) { add_copy(s, rt_dir(arg7(ctx)), PT_REGS_PARM5(ctx) * PT_REGS_PARM6(ctx)); rt_pending(s, K_COPY); }
    return 0;
}

/* cudaMemcpyPeer(dst, dstDevice, src, srcDevice, count[, stream]) */
int rt_memcpy_peer(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) add_copy(s, D_PEER, PT_REGS_PARM5(ctx));
    return 0;
}

/* cudaMemcpyToSymbol(symbol, src, count, offset, kind) / FromSymbol(dst, symbol, count, offset, kind) */
int rt_memcpy_symbol(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) add_copy(s, rt_dir(PT_REGS_PARM5(ctx)), PT_REGS_PARM3(ctx));
    return 0;
}

int rt_sync(struct pt_regs *ctx) {
    struct cstat_t *s = rt_get();
    if (s) { s->sync_calls++; rt_pending(s, K_SYNC); }
    return 0;
}

int rt_return(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct cstat_t *s = cstats.lookup(&tid);
    if (s) {
        if (s->depth)
            s->depth--;
        if (s->depth == 0) {   /* the outermost runtime call returns */
            account_return(s, s->rt_kind, s->rt_ts);
            s->rt_ts = 0;
            s->rt_kind = K_NONE;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ driver API (libcuda) */
static __always_inline struct cstat_t *drv_get(void) {
    struct cstat_t *s = get();
    if (s && s->depth) {      /* called by the runtime: already counted there */
        s->nested++;
        return 0;
    }
    return s;
}

int drv_launch(struct pt_regs *ctx) {
    struct cstat_t *s = drv_get();
    if (s) s->launches++;
    return 0;
}

int drv_launch_timed(struct pt_regs *ctx) {
    struct cstat_t *s = drv_get();
    if (s) { s->launches++; drv_pending(s, K_LAUNCH); }
    return 0;
}

int drv_graph(struct pt_regs *ctx) {
    struct cstat_t *s = drv_get();
    if (s) s->graph_launches++;
    return 0;
}

/* cuMemcpyHtoD_v2(dst, src, bytes), ...DtoH..., ...DtoD..., cuMemcpy(dst, src, bytes) and Async forms */
int drv_copy_htod(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) add_copy(s, D_HTOD, PT_REGS_PARM3(ctx)); return 0; }
int drv_copy_dtoh(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) add_copy(s, D_DTOH, PT_REGS_PARM3(ctx)); return 0; }
int drv_copy_dtod(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) add_copy(s, D_DTOD, PT_REGS_PARM3(ctx)); return 0; }
int drv_copy_other(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) add_copy(s, D_OTHER, PT_REGS_PARM3(ctx)); return 0; }
int drv_copy_htod_sync(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) { add_copy(s, D_HTOD, PT_REGS_PARM3(ctx)); drv_pending(s, K_COPY); } return 0; }
int drv_copy_dtoh_sync(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) { add_copy(s, D_DTOH, PT_REGS_PARM3(ctx)); drv_pending(s, K_COPY); } return 0; }
int drv_copy_dtod_sync(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) { add_copy(s, D_DTOD, PT_REGS_PARM3(ctx)); drv_pending(s, K_COPY); } return 0; }
int drv_copy_other_sync(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) { add_copy(s, D_OTHER, PT_REGS_PARM3(ctx)); drv_pending(s, K_COPY); } return 0; }

/* cuMemcpyPeer(dst, dstCtx, src, srcCtx, bytes[, stream]) */
int drv_copy_peer(struct pt_regs *ctx) { struct cstat_t *s = drv_get(); if (s) add_copy(s, D_PEER, PT_REGS_PARM5(ctx)); return 0; }

int drv_sync(struct pt_regs *ctx) {
    struct cstat_t *s = drv_get();
    if (s) { s->sync_calls++; drv_pending(s, K_SYNC); }
    return 0;
}

int drv_return(struct pt_regs *ctx) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct cstat_t *s = cstats.lookup(&tid);
    if (s) {
        account_return(s, s->drv_kind, s->drv_ts);
        s->drv_ts = 0;
        s->drv_kind = K_NONE;
    }
    return 0;
}

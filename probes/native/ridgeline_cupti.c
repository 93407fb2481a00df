/* libridgeline_cupti.so: CUPTI injection library for Ridgeline.
 *
 * Loaded by the CUDA driver from CUDA_INJECTION64_PATH at cuInit, which calls
 * InitializeInjection(). It collects CUPTI activity records and ships them, raw, to
 * the Ridgeline agent over a local unix socket. The agent decodes them (probes/cupti).
 *
 * Rules this file keeps (the served process must never be endangered):
 *  - libcupti is dlopen'ed, never linked: a missing or unusable libcupti/driver logs
 *    one clear line and the application runs on untouched.
 *  - CUPTI's buffer callbacks only copy and return. They never call Python, never
 *    block on I/O, never call back into CUPTI's flush. A bounded pool takes the copy;
 *    when it is full the buffer is dropped and counted.
 *  - One sender thread of our own does all socket work with non-blocking calls;
 *    an absent, slow or restarting agent costs dropped (and counted) records, never
 *    a stall. It reconnects on its own.
 *  - No cuptiFinalize (a shared process may have other CUPTI users; finalize poisons
 *    CUPTI for the rest of the process). Another subscriber (torch.profiler, Nsight)
 *    is detected and reported; we then stay passive instead of stealing its callbacks.
 *    One that takes CUPTI over later on a legacy CUPTI is detected from the sender
 *    thread, reported, and collection resumes when CUPTI shows it is done.
 *  - Builds with the CUPTI headers of CUDA 12.x and 13.x: fields are read at the fixed
 *    offsets of ridgeline_cupti_abi.h, record sizes come from the libcupti loaded.
 *  - The sender flushes CUPTI periodically (RIDGELINE_FLUSH_MS) and at stop (atexit, and
 *    SIGTERM when the application has no handler of its own), never from a callback.
 *
 * This file: the shared state, the checks of the header we are built with, and the entry
 * points the driver calls (InitializeInjection*). The parts, one concern a file, share
 * ridgeline_cupti_internal.h; the Makefile builds them into one library.
 */
#include "ridgeline_cupti_internal.h"

/* The fixed offsets of ridgeline_cupti_abi.h hold for the header we are built with. */
_Static_assert(offsetof(RL_HDR_KERNEL_T, name) == RL_KERNEL_OFF_NAME, "kernel name offset");
_Static_assert(offsetof(RL_HDR_KERNEL_T, deviceId) == RL_KERNEL_OFF_DEVICE_ID, "kernel deviceId offset");
_Static_assert(offsetof(RL_HDR_MEMCPY_T, deviceId) == RL_MEMCPY_OFF_DEVICE_ID, "memcpy deviceId offset");
_Static_assert(offsetof(RL_HDR_MEMSET_T, deviceId) == RL_MEMSET_OFF_DEVICE_ID, "memset deviceId offset");
_Static_assert(offsetof(CUpti_ActivityMarker2, name) == RL_MARKER_OFF_NAME, "marker name offset");
_Static_assert(offsetof(CUpti_ActivityMarker2, domain) == RL_MARKER_OFF_DOMAIN, "marker domain offset");
_Static_assert(sizeof(CUpti_ActivityMarker2) == RL_MARKER_MIN_SIZE, "Marker2 size");
#if CUPTI_API_VERSION >= 130202
_Static_assert(sizeof(rl_subscriber_params_t) == sizeof(CUpti_SubscriberParams) &&
                   offsetof(rl_subscriber_params_t, allowMultipleSubscribers) ==
                       offsetof(CUpti_SubscriberParams, allowMultipleSubscribers) &&
                   offsetof(rl_subscriber_params_t, oldSubscriberSize) == offsetof(CUpti_SubscriberParams, oldSubscriberSize),
               "CUpti_SubscriberParams layout");
_Static_assert(RL_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE == CUPTI_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE, "attr");
#endif
/* The largest BATCH body: header, every name at once (after a reconnect), one buffer's
 * records in sections. It must fit what the agent accepts. */
_Static_assert((uint64_t)sizeof(rl_batch_t) + (uint64_t)RL_MAX_NAMES * (sizeof(rl_name_t) + 7) + RL_MAX_NAME_BYTES_TOTAL +
                       RL_MAX_BUFFER_BYTES + 64 * sizeof(rl_section_t) <= RL_MAX_BODY_BYTES,
               "largest batch exceeds the agent's limit");
_Static_assert(sizeof(rl_frame_t) == 16 && sizeof(rl_batch_t) == 168 && sizeof(rl_hello_t) == 40, "wire");

/* ------------------------------------------------------------------------------------ */
/* state                                                                                 */

pthread_mutex_t g_pool_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t g_pool_cond = PTHREAD_COND_INITIALIZER;
pthread_mutex_t g_names_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t g_status_lock = PTHREAD_MUTEX_INITIALIZER;

slot_t *g_slots;
size_t g_slot_cap;
uint64_t g_seq;

name_ent_t *g_names;      /* open addressing on ptr */
uint32_t g_names_cap;     /* power of two */
uint32_t g_names_count;
uint32_t *g_name_order;   /* entry indices in insertion order */
uint32_t g_names_max;
char *g_strings;
size_t g_strings_used, g_strings_cap, g_strings_max;

uint32_t g_rec_size[RL_KIND_MAX]; /* 0 = unknown kind */
int g_walk_with_cupti;

atomic_int g_initialized;
atomic_int g_active;           /* collection set up, sender may run */
atomic_int g_sender_running;
atomic_int g_stop;
atomic_int g_mode;
atomic_uint g_sample_every;
atomic_uint g_flags;
uint32_t g_cupti_version;
pthread_t g_sender;
CUpti_SubscriberHandle g_sub;
int g_multi;
int g_test_mode;
int g_pid;
atomic_int g_outstanding_buffers;
atomic_uint_fast64_t g_kernel_counter;
atomic_int g_warned_kernel_layout;

struct rl_counters K;

char g_status[RL_STATUS_MAX];
atomic_uint g_status_gen;      /* bumped with every status line or flag change */
atomic_int g_taken_over;       /* legacy CUPTI: another client holds our callbacks */
atomic_int g_reclaim_req;      /* the agent asked to reclaim after a takeover */
atomic_int g_send_pending;     /* the sender holds a message not fully sent */
atomic_int g_exiting;          /* our atexit handler ran: no sender (re)start */
int g_wake_pipe[2] = {-1, -1}; /* SIGTERM handler -> sender: flush and ship now */
int g_ack_pipe[2] = {-1, -1};  /* sender -> SIGTERM handler: done */

atomic_int g_cupti_finalized;
atomic_uchar g_our_kind[RL_KIND_MAX];

/* ------------------------------------------------------------------------------------ */
/* exported entry points                                                                 */

/* CUPTI is off in this process: still tell the agent why (HELLO with the status line and
 * RL_FLAG_NO_CUPTI), so `ridgeline check` shows it. The sender is all that runs. */
static int report_only(void) {
    g_init_pid = getpid();
    pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    atomic_store(&g_active, 1);
    start_sender_if_needed();
    return 1;
}

int common_init(void) {
    read_config();
    if (g_peek_pipe[0] < 0 && make_pipe(g_peek_pipe)) g_peek_pipe[0] = g_peek_pipe[1] = -1;
    g_cbufs_cap = cfg.max_cupti_buffers * 2;
    g_cbufs = calloc(g_cbufs_cap, sizeof *g_cbufs);
    g_pid = getpid();
    atomic_store(&g_sample_every, cfg.kernel_sample_every);
    atomic_store(&g_mode, cfg.initial_mode);
    if (alloc_pool()) {
        rl_log("out of memory for the record pool; Ridgeline CUPTI collection off");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* which descendants are collected (docs/cupti.md, "Which processes are collected")      */

/* The environment reaches every descendant. Those matched here are left alone (no CUPTI,
 * no agent connection): Inductor's compile workers (torch/_inductor/compile_worker/
 * subproc_pool.py starts `python .../compile_worker/__main__.py`; older releases
 * `python -m torch._inductor.compile_worker`) and its autotune workers
 * (torch/_inductor/autotune_process.py starts `python .../__autotune_main__.py`), whose
 * kernel timings would otherwise be taken under CUPTI's overhead. Engine workers (vLLM's
 * and SGLang's multiprocessing children) match nothing and are collected.
 * RIDGELINE_INJECT_SKIP=a;b;... replaces the list ("" collects every process); an entry
 * matches an argument among the first RL_SKIP_ARGS that ends with it.
 * Kept equal to DEFAULT_SKIP of probes/cupti/injection_policy.py (tests check). */
#define RL_DEFAULT_SKIP                                                                  \
    "torch/_inductor/compile_worker/__main__.py;torch._inductor.compile_worker;"         \
    "torch/_inductor/__autotune_main__.py;torch._inductor.autotune_process"
#define RL_SKIP_ARGS 4
const char rl_default_skip[] = RL_DEFAULT_SKIP;

/* 1 when the policy leaves this process alone; why names the matching entry. */
static int policy_skips(char *why, size_t why_cap) {
    const char *list = getenv("RIDGELINE_INJECT_SKIP");
    if (!list) list = RL_DEFAULT_SKIP;
    if (!*list) return 0;
    char args[8192];
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, args, sizeof args - 1);
    close(fd);
    if (n <= 0) return 0;
    args[n] = 0;
    const char *a = args + strlen(args) + 1; /* argv[1] */
    for (int i = 0; i < RL_SKIP_ARGS && a < args + n; i++, a += strlen(a) + 1) {
        size_t la = strlen(a);
        for (const char *e = list; *e;) {
            size_t le = strcspn(e, ";");
            if (le && le <= la && !strncmp(a + la - le, e, le)) {
                snprintf(why, why_cap, "%.*s", (int)le, e);
                return 1;
            }
            e += le + (e[le] == ';');
        }
    }
    return 0;
}

static int g_skipped = -1; /* -1 not decided yet */

static int skipped_by_policy(void) {
    if (g_skipped < 0) {
        char why[512] = {0};
        g_skipped = policy_skips(why, sizeof why);
        if (g_skipped && !getenv("RIDGELINE_QUIET"))
            fprintf(stderr, "ridgeline-cupti[%d]: not collected: this process matches \"%s\" of the injection "
                            "policy (RIDGELINE_INJECT_SKIP)\n", (int)getpid(), why);
    }
    return g_skipped;
}

/* Called by the CUDA driver during cuInit. Always returns 1: whatever happens here, the
 * application continues, with or without Ridgeline. */
RL_EXPORT int InitializeInjection(void) {
    if (atomic_exchange(&g_initialized, 1)) return 1;
    const char *dis = getenv("RIDGELINE_DISABLE");
    if (dis && *dis && strcmp(dis, "0")) return 1;
    if (skipped_by_policy()) return 1;
    if (common_init()) return 1;
    const char *nvtx_owner;
    if (foreign_injection("NVTX_INJECTION64_PATH", &nvtx_owner))
        rl_log("NVTX_INJECTION64_PATH=%s names another tool: NVTX ranges go to it, not to Ridgeline, and steps "
               "are cut from the kernels alone", nvtx_owner);
    char why[2048] = {0};
    if (!C.lib && !(C.lib = load_cupti(why, sizeof why))) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        rl_log("CUPTI collection off: %s; the application runs without Ridgeline", why);
        return report_only();
    }
    if (resolve_cupti(why, sizeof why)) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        rl_log("CUPTI collection off: %s", why);
        return report_only();
    }
    CUptiResult r = C.GetVersion(&g_cupti_version);
    if (r != CUPTI_SUCCESS) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        rl_log("CUPTI collection off: cuptiGetVersion failed: %s (%d) (no usable CUDA driver?)", cupti_err(r), (int)r);
        return report_only();
    }
    sizes_for_runtime(g_cupti_version);
    Dl_info di;
    rl_log("using %s (CUPTI version %u, headers %u)",
           dladdr((void *)C.GetVersion, &di) && di.dli_fname ? di.dli_fname : "libcupti", g_cupti_version,
           (unsigned)CUPTI_API_VERSION);
    int claim = claim_cupti();
    if (claim == 2) {
        atomic_fetch_or(&g_flags, RL_FLAG_NO_CUPTI);
        return report_only();
    }
    if (claim == 0 && setup_collection() != 0) atomic_fetch_or(&g_flags, RL_FLAG_CONFLICT);
    g_init_pid = getpid();
    pthread_atfork(at_fork_prepare, at_fork_parent, at_fork_child);
    atexit(at_exit);
    if (claim == 0) install_sigterm();
    atomic_store(&g_active, 1);
    start_sender_if_needed(); /* also on conflict: the agent learns why there is no data */
    return 1;
}

/* NVTX_INJECTION64_PATH may name this library: forward NVTX to the libcupti we use, so
 * NVTX ranges arrive as MARKER records in the same CUPTI instance. */
RL_EXPORT int InitializeInjectionNvtx2(void *get_export_table) {
    char why[2048] = {0};
    const char *dis = getenv("RIDGELINE_DISABLE");
    if (dis && *dis && strcmp(dis, "0")) return 0;
    if (skipped_by_policy()) return 0;
    if (!C.lib && !(C.lib = load_cupti(why, sizeof why))) {
        rl_log("NVTX forwarding off: %s", why);
        return 0;
    }
    fn_NvtxInit f = (fn_NvtxInit)dlsym(C.lib, "InitializeInjectionNvtx2");
    if (!f) {
        rl_log("NVTX forwarding off: libcupti has no InitializeInjectionNvtx2");
        return 0;
    }
    return f(get_export_table);
}

/* NVTX extensions (payloads, counters, memory: nvtxExtImplInit.h of NVTX 3) look up
 * InitializeInjectionNvtxExtension in the library NVTX_INJECTION64_PATH names, not
 * InitializeInjectionNvtx2: forwarded the same way, to the libcupti that exports it
 * (13.x does; 12.x does not, and the extension then stays off, as without Ridgeline). */
typedef int (*fn_NvtxExtInit)(void *);
RL_EXPORT int InitializeInjectionNvtxExtension(void *export_function) {
    char why[2048] = {0};
    const char *dis = getenv("RIDGELINE_DISABLE");
    if (dis && *dis && strcmp(dis, "0")) return 0;
    if (skipped_by_policy()) return 0;
    if (!C.lib && !(C.lib = load_cupti(why, sizeof why))) {
        rl_log("NVTX extension forwarding off: %s", why);
        return 0;
    }
    fn_NvtxExtInit f = (fn_NvtxExtInit)dlsym(C.lib, "InitializeInjectionNvtxExtension");
    if (!f) {
        rl_log("NVTX extension forwarding off: libcupti has no InitializeInjectionNvtxExtension");
        return 0;
    }
    return f(export_function);
}

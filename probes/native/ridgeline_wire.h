/* Wire format between libridgeline_cupti.so (in the served process) and the agent's
 * CUPTI probe (probes/cupti/protocol.py mirrors every struct here; keep them in step).
 *
 * A stream of frames over a unix-domain SOCK_STREAM socket. Every integer is
 * little-endian (the only byte order CUDA hosts run), every variable-length part is
 * padded to 8 bytes so the agent can view record sections with numpy without copying.
 *
 *   frame   = rl_frame_t (16 B) + body (length bytes)
 *   HELLO   = rl_hello_t + comm (padded) + status text (padded)
 *             + n_sizes * rl_kind_size_t + n_cbids * (rl_cbid_t + name (padded))
 *   BATCH   = rl_batch_t + n_names * (rl_name_t + bytes (padded))
 *             + n_sections * (rl_section_t + count * record_size bytes)
 *   CONTROL = rl_control_t                                   (agent -> library)
 *
 * A library may send HELLO again on the same connection whenever its flags or status
 * lines change (a takeover detected or over); the newest HELLO is the state.
 *
 * Record sections hold CUPTI activity records exactly as CUPTI wrote them, grouped by
 * kind (the library walks the buffer once to find kernel-name pointers anyway, and
 * grouping lets the agent decode each kind with one numpy view instead of a Python
 * walk). Name pointers inside records stay raw; rl_name_t maps them to strings.
 */
#ifndef RIDGELINE_WIRE_H
#define RIDGELINE_WIRE_H
#include <stdint.h>

#define RL_MAGIC 0x31434C52u /* "RLC1" as little-endian bytes */
#define RL_PROTO_VERSION 1
#define RL_MAX_DEVICES 16

/* Size bounds. The agent refuses a frame body over RL_MAX_BODY_BYTES (MAX_BODY_BYTES of
 * probes/cupti/protocol.py, keep them equal); the library keeps every BATCH under it: a
 * buffer is at most RL_MAX_BUFFER_BYTES (RIDGELINE_BUFFER_BYTES is lowered to it), and
 * the names it may send at once at most RL_MAX_NAMES strings of RL_MAX_NAME_BYTES_TOTAL
 * bytes in all (ridgeline_cupti.c static-asserts the sum). A name is at most 4096 bytes
 * (MAX_NAME_BYTES); a longer one is cut and ends in "#" + 16 hex digits of a hash of the
 * full name, so names that differ only past the cut stay distinct. */
#define RL_MAX_BODY_BYTES (96u << 20)
#define RL_MAX_BUFFER_BYTES (64u << 20)
#define RL_MAX_NAME_BYTES_TOTAL (16u << 20)
#define RL_MAX_NAMES (1u << 18)

enum {
    RL_MSG_HELLO = 1,
    RL_MSG_BATCH = 2,
    RL_MSG_CONTROL = 3,
};

/* Collection modes the agent can switch between without restarting the process. */
enum {
    RL_MODE_ALWAYS_ON = 0, /* kernels, copies, launch/sync runtime+driver API, NVTX ranges, external ids */
    RL_MODE_DEEP = 1,      /* + NVTX payloads, queued/submitted timestamps, no kernel sampling */
};

/* rl_hello_t.flags / rl_batch_t.flags */
enum {
    RL_FLAG_GRAPH_LEVEL = 1u << 0,       /* GRAPH_TRACE enabled: one record per graph launch */
    RL_FLAG_MULTI_SUBSCRIBER = 1u << 1,  /* CUPTI multi-subscriber (v2) mode */
    RL_FLAG_CONFLICT = 1u << 2,          /* another CUPTI subscriber holds CUPTI: we stay passive */
    RL_FLAG_NO_CUPTI = 1u << 3,          /* libcupti not usable in this process */
    RL_FLAG_TEST_MODE = 1u << 4,         /* driven by ridgeline_test_* entry points */
    RL_FLAG_WALK_WITH_CUPTI = 1u << 5,   /* record sizes taken from cuptiActivityGetNextRecord */
    /* Legacy (single-subscriber) CUPTI only: another client (torch.profiler/Kineto, ...)
     * re-registered the process-global activity buffer callbacks after us, so CUPTI now
     * hands our records to it; collection is paused until it is done (see docs/cupti.md).
     * Set and cleared while the process runs: the library sends a fresh HELLO whenever
     * its flags or status lines change, and every BATCH carries the current flags. The
     * status text explains it in lines starting "takeover:" and, once collection is
     * back, "resumed:". */
    RL_FLAG_TAKEN_OVER = 1u << 6,
};

/* rl_control_t.flags (agent -> library) */
enum {
    /* Re-register Ridgeline's buffer callbacks and activity kinds after a takeover, for
     * when the operator knows the other tool is done and CUPTI cannot tell (CUDA 12.x
     * without teardown). Ignored when no takeover was detected. */
    RL_CONTROL_RECLAIM = 1u << 0,
};

/* API categories, numerically equal to probes/events.py API_* constants. */
enum { RL_API_OTHER = 0, RL_API_LAUNCH = 1, RL_API_GRAPH_LAUNCH = 2, RL_API_SYNC = 3, RL_API_MEMCPY = 4,
       RL_API_MEMSET = 5 }; /* = API_* of probes/events.py */
/* API domains, numerically equal to probes/events.py API_DOMAIN_*. */
enum { RL_DOMAIN_RUNTIME = 1, RL_DOMAIN_DRIVER = 2 };

typedef struct {
    uint32_t magic;
    uint16_t type;
    uint16_t proto;
    uint32_t length; /* body bytes */
    uint32_t reserved;
} rl_frame_t;

typedef struct {
    uint32_t pid;
    uint32_t cupti_version;      /* cuptiGetVersion() of the libcupti in use, 0 if none */
    uint32_t header_api_version; /* CUPTI_API_VERSION the library was compiled against */
    uint32_t mode;
    uint32_t flags;
    uint32_t kernel_sample_every;
    uint32_t comm_len;
    uint32_t status_len;
    uint32_t n_sizes;
    uint32_t n_cbids;
} rl_hello_t;

typedef struct {
    uint32_t kind;
    uint32_t size;
} rl_kind_size_t;

typedef struct {
    uint32_t domain;
    uint32_t cbid;
    uint32_t category;
    uint32_t name_len;
} rl_cbid_t;

typedef struct {
    uint32_t pid;
    uint32_t cupti_version;
    uint64_t seq;
    uint32_t mode;
    uint32_t flags;
    uint32_t kernel_sample_every;
    uint32_t n_devices;
    uint32_t n_names;
    uint32_t n_sections;
    uint64_t records;            /* records in this batch */
    /* cumulative counters since the library started */
    uint64_t dropped_cupti;      /* CUPTI's own dropped-record count */
    uint64_t dropped_pool_full;  /* records dropped: no free pool slot */
    uint64_t dropped_no_agent;   /* records dropped: agent socket absent */
    uint64_t dropped_send;       /* records dropped: agent too slow, connection abandoned */
    uint64_t sampled_out;        /* kernel records skipped by always-on sampling (not a loss) */
    uint64_t names_dropped;      /* names not interned: table full */
    uint64_t walk_errors;        /* buffers cut short: unknown record kind */
    uint32_t device_ids[RL_MAX_DEVICES];
} rl_batch_t;

typedef struct {
    uint64_t ptr;
    uint32_t len;
    uint32_t reserved;
} rl_name_t;

typedef struct {
    uint32_t kind;
    uint32_t record_size;
    uint32_t count;
    uint32_t reserved;
} rl_section_t;

typedef struct {
    uint32_t mode;
    uint32_t kernel_sample_every; /* 0 = leave unchanged */
    uint32_t flags;               /* RL_CONTROL_* (was reserved, sent as 0 by older agents) */
    uint32_t reserved;
} rl_control_t;

#endif

/* Buffers: the sizes of records, the buffers handed to CUPTI (and the sinks given instead of
 * a refusal), and the completed-buffer path into the bounded pool of slots the sender ships.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* ------------------------------------------------------------------------------------ */
/* record sizes and the buffer walk                                                      */

void sizes_from_header(void) {
    memset(g_rec_size, 0, sizeof g_rec_size);
    g_rec_size[CUPTI_ACTIVITY_KIND_KERNEL] = sizeof(RL_HDR_KERNEL_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL] = sizeof(RL_HDR_KERNEL_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_MEMCPY] = sizeof(RL_HDR_MEMCPY_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_MEMSET] = sizeof(RL_HDR_MEMSET_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_RUNTIME] = sizeof(CUpti_ActivityAPI);
    g_rec_size[CUPTI_ACTIVITY_KIND_DRIVER] = sizeof(CUpti_ActivityAPI);
    g_rec_size[CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API] = sizeof(CUpti_ActivityAPI);
    g_rec_size[CUPTI_ACTIVITY_KIND_MARKER] = sizeof(CUpti_ActivityMarker2);
    g_rec_size[CUPTI_ACTIVITY_KIND_MARKER_DATA] = sizeof(RL_HDR_MARKER_DATA_T);
    g_rec_size[CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION] = sizeof(CUpti_ActivityExternalCorrelation);
    g_rec_size[CUPTI_ACTIVITY_KIND_GRAPH_TRACE] = sizeof(CUpti_ActivityGraphTrace2);
}

/* Sizes for the libcupti actually loaded, never the compiled-in header's: CUPTI >= 13.2
 * tells us (cuptiActivityGetStructSize); an older one (a libcupti.so.12 torch loaded,
 * 13.0, 13.1) is walked with its own cuptiActivityGetNextRecord. */
void sizes_for_runtime(uint32_t version) {
    (void)version;
    if (C.StructSize) {
        memset(g_rec_size, 0, sizeof g_rec_size);
        int ok = 1;
        static const CUpti_ActivityKind kinds[] = {
            /* needed: */
            CUPTI_ACTIVITY_KIND_KERNEL, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
            CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER,
            CUPTI_ACTIVITY_KIND_MARKER, CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
            /* optional: */
            CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API, CUPTI_ACTIVITY_KIND_MARKER_DATA, CUPTI_ACTIVITY_KIND_GRAPH_TRACE};
        /* the kinds always enabled must be sized; the others (deep mode, graph level) may be
         * unknown to this release: their records then end a walk, counted */
        for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
            size_t s = 0;
            int needed = i < 8;
            if (C.StructSize(kinds[i], 0, &s) != CUPTI_SUCCESS || s == 0 || s % 8 || s > RL_MAX_RECORD_BYTES) {
                if (needed) ok = 0;
            } else {
                g_rec_size[kinds[i]] = (uint32_t)s;
            }
        }
        if (ok) return;
        memset(g_rec_size, 0, sizeof g_rec_size);
    }
    g_walk_with_cupti = 1;
    atomic_fetch_or(&g_flags, RL_FLAG_WALK_WITH_CUPTI);
}

/* Size of the record at p, or 0 when the walk must stop. */
size_t record_size(uint8_t *buf, size_t valid, uint8_t *p) {
    size_t left = valid - (size_t)(p - buf);
    if (left < 8) return 0;
    int32_t kind;
    memcpy(&kind, p, 4);
    if (g_walk_with_cupti && C.GetNextRecord) {
        CUpti_Activity *rec = (CUpti_Activity *)p;
        /* GetNextRecord advances from the record it was given; sizes it reveals are
         * remembered so the last record of a buffer (no successor) gets its own size. */
        CUptiResult r = C.GetNextRecord(buf, valid, &rec);
        if (r == CUPTI_SUCCESS) {
            size_t sz = (size_t)((uint8_t *)rec - p);
            if ((uint8_t *)rec <= p || sz % 8 || sz > RL_MAX_RECORD_BYTES || sz > left) return 0;
            if (kind > 0 && kind < RL_KIND_MAX) g_rec_size[kind] = (uint32_t)sz;
            return sz;
        }
        /* No successor. For the last record (MAX_LIMIT_REACHED) the size is what is left
         * of the valid bytes, provided that agrees with what this kind measured before
         * (or is plausible for a kind not seen yet). Any other error is about the next
         * record (CUPTI checks it): this one still has the size its kind measured, and the
         * walk stops at the next. Never make the rest of the buffer one oversized record. */
        if (kind <= 0 || kind >= RL_KIND_MAX) return 0;
        if (r != CUPTI_ERROR_MAX_LIMIT_REACHED) return g_rec_size[kind] && g_rec_size[kind] < left ? g_rec_size[kind] : 0;
        if (g_rec_size[kind]) return g_rec_size[kind] == left ? left : 0;
        return (left % 8 == 0 && left <= RL_MAX_RECORD_BYTES) ? left : 0;
    }
    if (kind <= 0 || kind >= RL_KIND_MAX || g_rec_size[kind] == 0 || g_rec_size[kind] > left) return 0;
    return g_rec_size[kind];
}

static const uint32_t RL_KERNEL_SIZES[] = RL_KERNEL_KNOWN_SIZES;

static int kernel_layout_known(size_t sz) {
    for (size_t i = 0; i < sizeof RL_KERNEL_SIZES / sizeof RL_KERNEL_SIZES[0]; i++)
        if (RL_KERNEL_SIZES[i] == sz) return 1;
    return 0;
}

static void note_device(slot_t *s, uint32_t dev) {
    for (uint32_t i = 0; i < s->n_devices; i++)
        if (s->devices[i] == dev) return;
    if (s->n_devices < RL_MAX_DEVICES) s->devices[s->n_devices++] = dev;
}

static uint64_t count_records(uint8_t *buf, size_t valid) {
    uint64_t n = 0;
    uint8_t *p = buf;
    size_t sz;
    while ((size_t)(p - buf) < valid && (sz = record_size(buf, valid, p)) != 0) {
        n++;
        p += sz;
    }
    return n;
}

/* The completed-buffer path: copy records into a pool slot grouped by kind, intern the
 * new name pointers, hand the slot to the sender, return. Never blocks on I/O. */
void process_buffer(uint8_t *buf, size_t valid) {
    if (!buf || valid == 0 || !g_slots) return;
    if (getpid() != g_pid) {
        /* forked child: our sender thread did not survive the fork */
        g_pid = getpid();
        atomic_store(&g_sender_running, 0);
    }
    start_sender_if_needed();

    slot_t *slot = NULL;
    pthread_mutex_lock(&g_pool_lock);
    for (unsigned i = 0; i < cfg.pool_slots; i++)
        if (g_slots[i].state == SLOT_FREE) {
            slot = &g_slots[i];
            slot->state = SLOT_FILLING;
            break;
        }
    pthread_mutex_unlock(&g_pool_lock);
    if (!slot) {
        atomic_fetch_add(&K.dropped_pool_full, count_records(buf, valid));
        return;
    }

    /* pass 1: count per kind */
    uint32_t counts[RL_KIND_MAX] = {0};
    uint32_t sizes[RL_KIND_MAX] = {0};
    uint8_t *p = buf, *end = buf + valid;
    size_t sz = 0;
    int cut = 0;
    while (p < end) {
        sz = record_size(buf, valid, p);
        if (!sz) {
            cut = 1;
            break;
        }
        int32_t kind;
        memcpy(&kind, p, 4);
        if (kind <= 0 || kind >= RL_KIND_MAX || (sizes[kind] && sizes[kind] != sz)) {
            cut = 1;
            break;
        }
        sizes[kind] = (uint32_t)sz;
        counts[kind]++;
        p += sz;
    }
    if (cut) atomic_fetch_add(&K.walk_errors, 1);
    uint8_t *walk_end = p;

    /* lay out sections */
    size_t offs[RL_KIND_MAX];
    size_t used = 0;
    uint32_t nsec = 0;
    /* Deep mode is for seeing everything: sampling applies to always-on only. */
    unsigned every = atomic_load(&g_mode) == RL_MODE_DEEP ? 1 : atomic_load(&g_sample_every);
    if (!every) every = 1;
    for (int k = 1; k < RL_KIND_MAX; k++) {
        if (!counts[k]) continue;
        offs[k] = used + sizeof(rl_section_t);
        used = offs[k] + (size_t)counts[k] * sizes[k];
        nsec++;
    }
    if (used > g_slot_cap) { /* cannot happen: sections add 16 B per kind to a buffer <= slot */
        pthread_mutex_lock(&g_pool_lock);
        slot->state = SLOT_FREE;
        pthread_mutex_unlock(&g_pool_lock);
        atomic_fetch_add(&K.dropped_pool_full, count_records(buf, valid));
        return;
    }

    /* pass 2: copy, intern names, sample kernels in always-on mode */
    uint32_t kept[RL_KIND_MAX] = {0};
    uint64_t sampled = 0;
    uint32_t unknown_kernel_size = 0;
    slot->n_devices = 0;
    rl_clock_map_t clk;
    clock_snapshot(&clk);
    pthread_mutex_lock(&g_names_lock);
    for (p = buf; p < walk_end; p += sz) {
        int32_t kind;
        memcpy(&kind, p, 4);
        sz = sizes[kind];
        if (!record_ours(p, kind, sz)) continue; /* another client's kind, in a shared CUPTI */
        if (kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            if (every > 1 && (atomic_fetch_add(&g_kernel_counter, 1) % every) != 0) {
                sampled++;
                continue;
            }
            /* Only a layout we know has its name pointer at RL_KERNEL_OFF_NAME; in any other
             * record that offset may hold anything, and dereferencing it could crash the
             * served process. Such records still go to the agent, nameless. */
            if (kernel_layout_known(sz)) {
                uintptr_t nm;
                memcpy(&nm, p + RL_KERNEL_OFF_NAME, sizeof nm);
                intern_ptr(nm);
                uint32_t dev;
                memcpy(&dev, p + RL_KERNEL_OFF_DEVICE_ID, 4);
                note_device(slot, dev);
            } else {
                unknown_kernel_size = (uint32_t)sz;
            }
        } else if (kind == CUPTI_ACTIVITY_KIND_MARKER && sz >= RL_MARKER_MIN_SIZE) {
            uintptr_t nm, dom;
            memcpy(&nm, p + RL_MARKER_OFF_NAME, sizeof nm);
            memcpy(&dom, p + RL_MARKER_OFF_DOMAIN, sizeof dom);
            intern_ptr(nm);
            intern_ptr(dom);
        } else if ((kind == CUPTI_ACTIVITY_KIND_MEMCPY || kind == CUPTI_ACTIVITY_KIND_MEMSET) &&
                   sz >= RL_MEMCPY_OFF_DEVICE_ID + 4) {
            uint32_t dev;
            memcpy(&dev, p + (kind == CUPTI_ACTIVITY_KIND_MEMCPY ? RL_MEMCPY_OFF_DEVICE_ID : RL_MEMSET_OFF_DEVICE_ID), 4);
            note_device(slot, dev);
        }
        memcpy(slot->data + offs[kind] + (size_t)kept[kind] * sz, p, sz);
        (void)clock_fix(slot->data + offs[kind] + (size_t)kept[kind] * sz, kind, sz, &clk);
        kept[kind]++;
    }
    pthread_mutex_unlock(&g_names_lock);
    if (unknown_kernel_size && !atomic_exchange(&g_warned_kernel_layout, 1))
        rl_log("kernel records of %u bytes: layout not known to this library; sent without names", unknown_kernel_size);

    /* section headers (sampling may have left a kernel section shorter: compact) */
    size_t w = 0;
    uint64_t total = 0;
    nsec = 0;
    for (int k = 1; k < RL_KIND_MAX; k++) {
        if (!counts[k] || !kept[k]) continue;
        rl_section_t h = {(uint32_t)k, sizes[k], kept[k], 0};
        size_t bytes = (size_t)kept[k] * sizes[k];
        memmove(slot->data + w + sizeof h, slot->data + offs[k], bytes);
        memcpy(slot->data + w, &h, sizeof h);
        w += sizeof h + bytes;
        total += kept[k];
        nsec++;
    }
    if (sampled) atomic_fetch_add(&K.sampled_out, sampled);
    atomic_fetch_add(&K.records_in, total);
    slot->used = w;
    slot->records = total;
    slot->n_sections = nsec;

    pthread_mutex_lock(&g_pool_lock);
    slot->seq = ++g_seq;
    slot->state = nsec ? SLOT_READY : SLOT_FREE;
    pthread_cond_signal(&g_pool_cond);
    pthread_mutex_unlock(&g_pool_lock);
}

/* ------------------------------------------------------------------------------------ */
/* sink buffers: refusing a buffer (NULL) can crash CUPTI before API version 27 (CUDA 12.9;
 * 12.4 reports 22, 12.8 26). There a refused request gets a sink instead: CUPTI writes into
 * it, and its records are dropped on completion and counted as dropped_cupti, which is
 * what CUPTI itself counts when it has no buffer. Sinks are small and bounded; past
 * RL_MAX_SINKS all further ones share one static sink, never read and never freed.      */

#define RL_CUPTI_NULL_BUFFER_SAFE 27
#define RL_SINK_BYTES ((size_t)256 << 10)
#define RL_MAX_SINKS 64
static pthread_mutex_t g_sink_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *g_sinks[RL_MAX_SINKS];
static _Alignas(8) uint8_t g_static_sink[RL_SINK_BYTES];
atomic_uint_fast64_t g_sinks_handed;   /* sinks handed out (for the tests) */

/* 1 when this libcupti may crash on a NULL buffer (0 = not reported: be safe). */
static int null_buffer_unsafe(void) { return g_cupti_version < RL_CUPTI_NULL_BUFFER_SAFE; }

static uint8_t *sink_get(void) {
    uint8_t *b = malloc(RL_SINK_BYTES);
    pthread_mutex_lock(&g_sink_lock);
    int placed = 0;
    for (unsigned i = 0; b && i < RL_MAX_SINKS; i++)
        if (!g_sinks[i]) {
            g_sinks[i] = b;
            placed = 1;
            break;
        }
    pthread_mutex_unlock(&g_sink_lock);
    if (!placed) {
        free(b);
        b = g_static_sink;
    }
    memset(b, 0, 8);
    atomic_fetch_add(&g_sinks_handed, 1);
    return b;
}

/* If b is a sink: count its records as dropped, free it, return 1. */
static uint64_t count_records(uint8_t *buf, size_t valid);
static int sink_release(uint8_t *b, size_t valid) {
    int found = b == g_static_sink;
    if (!found) {
        pthread_mutex_lock(&g_sink_lock);
        for (unsigned i = 0; i < RL_MAX_SINKS; i++)
            if (g_sinks[i] == b) {
                g_sinks[i] = NULL;
                found = 1;
                break;
            }
        pthread_mutex_unlock(&g_sink_lock);
        if (!found) return 0;
        if (valid) atomic_fetch_add(&K.dropped_cupti, count_records(b, valid));
        free(b);
        return 1;
    }
    /* the static sink may be written by several CUPTI buffers at once: its content is
     * not trusted; each completion counts as at least one record lost */
    atomic_fetch_add(&K.dropped_cupti, valid ? 1 : 0);
    return 1;
}

/* ------------------------------------------------------------------------------------ */
/* CUPTI buffer callbacks                                                                */

static void refuse_buffer(uint8_t **buffer, size_t *size) {
    atomic_fetch_add(&K.buffers_refused, 1);
    if (!null_buffer_unsafe()) return;
    *buffer = sink_get();
    *size = RL_SINK_BYTES;
}

void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *max_records = 0;
    *size = 0;
    *buffer = NULL;
    /* Bounded: past the cap CUPTI drops records and counts them (reported as dropped_cupti);
     * before CUPTI API version 27 CUPTI gets a sink instead of NULL (see sink_get). */
    if (atomic_fetch_add(&g_outstanding_buffers, 1) >= (int)cfg.max_cupti_buffers) {
        atomic_fetch_sub(&g_outstanding_buffers, 1);
        refuse_buffer(buffer, size);
        return;
    }
    void *b = NULL;
    if (posix_memalign(&b, 8, cfg.buffer_bytes) != 0) {
        atomic_fetch_sub(&g_outstanding_buffers, 1);
        refuse_buffer(buffer, size);
        return;
    }
    memset(b, 0, 8); /* kind 0 until CUPTI writes a record: what watch_takeover looks at */
    cbuf_add(b);
    *buffer = b;
    *size = cfg.buffer_bytes;
}

/* Frees a buffer CUPTI gave back. Any buffer reaching our callback while a takeover is
 * flagged (in particular one we had counted as lost) means there was none: a long-running
 * record held that buffer back. */
static void buffer_done(uint8_t *buffer) {
    if (!buffer) return;
    int r = cbuf_remove(buffer);
    if (r > 0) {
        /* Another client's buffer: after a reclaim while that tool (Kineto) still had
         * buffers inside CUPTI, CUPTI completes them to us. Its owner frees it (Kineto's
         * CuptiActivityBuffer is a std::vector): freeing it here would be a double free in
         * the served process. Its records were read; the buffer is left alone. (A buffer
         * of ours whose entry was forgotten after a takeover leaks here instead.) */
        static atomic_int said;
        if (!atomic_exchange(&said, 1))
            rl_log("reclaim: a buffer of another CUPTI client reached Ridgeline (it was still collecting); "
                   "left to its owner");
        return;
    }
    int was_lost = r < 0;
    free(buffer);
    if (!was_lost) atomic_fetch_sub(&g_outstanding_buffers, 1);
    /* CUPTI still calls *our* completion callback: nobody replaced it */
    if (was_lost || atomic_load(&g_taken_over)) takeover_false_alarm();
}

void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream_id, uint8_t *buffer, size_t size,
                                      size_t valid) {
    /* counted before the records are queued, so the batch carrying them reports it */
    if (C.GetNumDropped) {
        size_t dropped = 0;
        if (C.GetNumDropped(ctx, stream_id, &dropped) == CUPTI_SUCCESS && dropped)
            atomic_fetch_add(&K.dropped_cupti, dropped);
    }
    if (sink_release(buffer, valid)) return;
    process_buffer(buffer, valid);
    /* shared CUPTI (preloaded): a buffer the other client handed CUPTI before we registered
     * goes back to it whole; ours give it a copy of its kinds */
    if (!cbuf_known(buffer) && guest_own_buffer(buffer, size, valid)) return;
    guest_tee(buffer, valid);
    buffer_done(buffer);
}

void CUPTIAPI buffer_requested2(uint8_t **buffer, size_t *size, size_t *max_records,
                                       void *info) {
    (void)info;
    buffer_requested(buffer, size, max_records);
}

void CUPTIAPI buffer_completed2(uint8_t *buffer, size_t size, size_t valid,
                                       void *info) {
    (void)info;
    (void)size;
    /* Our subscriber's own dropped count (CUPTI 13.3+; reading resets it). 13.2 has only
     * the process-wide v1 count, read as a fallback. */
    size_t dropped = 0;
    if (C.GetNumDropped2) {
        if (C.GetNumDropped2(g_sub, NULL, 0, &dropped) != CUPTI_SUCCESS) dropped = 0;
    } else if (C.GetNumDropped) {
        if (C.GetNumDropped(NULL, 0, &dropped) != CUPTI_SUCCESS) dropped = 0;
    }
    if (dropped) atomic_fetch_add(&K.dropped_cupti, dropped);
    if (sink_release(buffer, valid)) return;
    process_buffer(buffer, valid);
    buffer_done(buffer);
}

void CUPTIAPI subscriber_callback(void *ud, CUpti_CallbackDomain d, CUpti_CallbackId id, const void *data) {
    (void)ud; (void)d; (void)id; (void)data; /* we enable no callbacks; the handle only claims/probes CUPTI */
}

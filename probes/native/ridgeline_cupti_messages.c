/* Messages to the agent: HELLO and BATCH frames (ridgeline_wire.h) built from the pool's slots.
 * Part of libridgeline_cupti.so (see ridgeline_cupti.c). */
#include "ridgeline_cupti_internal.h"

/* ------------------------------------------------------------------------------------ */
/* sender thread                                                                         */

static int grow(outmsg_t *m, size_t need) {
    if (m->len + need <= m->cap) return 0;
    size_t c = m->cap ? m->cap : 1 << 16;
    while (c < m->len + need) c *= 2;
    uint8_t *n = realloc(m->buf, c);
    if (!n) return -1;
    m->buf = n;
    m->cap = c;
    return 0;
}

static int put(outmsg_t *m, const void *p, size_t n) {
    if (grow(m, n + 8)) return -1;
    memcpy(m->buf + m->len, p, n);
    m->len += n;
    return 0;
}

static int pad8(outmsg_t *m) {
    static const uint8_t z[8] = {0};
    size_t r = m->len % 8;
    return r ? put(m, z, 8 - r) : 0;
}

static void frame_begin(outmsg_t *m, uint16_t type) {
    rl_frame_t f = {RL_MAGIC, type, RL_PROTO_VERSION, 0, 0};
    m->len = m->sent = 0;
    m->records = 0;
    put(m, &f, sizeof f);
}

static void frame_end(outmsg_t *m) {
    uint32_t body = (uint32_t)(m->len - sizeof(rl_frame_t));
    memcpy(m->buf + offsetof(rl_frame_t, length), &body, 4);
}

void build_hello(outmsg_t *m) {
    char comm[256] = {0};
    FILE *f = fopen("/proc/self/comm", "r");
    if (f) {
        if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
        fclose(f);
        comm[strcspn(comm, "\n")] = 0;
    }
    char status[RL_STATUS_MAX];
    pthread_mutex_lock(&g_status_lock);
    memcpy(status, g_status, sizeof status);
    pthread_mutex_unlock(&g_status_lock);
    uint32_t n_sizes = 0;
    for (int k = 0; k < RL_KIND_MAX; k++) n_sizes += g_rec_size[k] != 0;
    rl_hello_t h = {(uint32_t)g_pid, g_cupti_version, CUPTI_API_VERSION, (uint32_t)atomic_load(&g_mode),
                    atomic_load(&g_flags), atomic_load(&g_sample_every), (uint32_t)strlen(comm),
                    (uint32_t)strlen(status), n_sizes, (uint32_t)N_CBIDS};
    frame_begin(m, RL_MSG_HELLO);
    put(m, &h, sizeof h);
    put(m, comm, h.comm_len);
    pad8(m);
    put(m, status, h.status_len);
    pad8(m);
    for (int k = 0; k < RL_KIND_MAX; k++)
        if (g_rec_size[k]) {
            rl_kind_size_t ks = {(uint32_t)k, g_rec_size[k]};
            put(m, &ks, sizeof ks);
        }
    for (size_t i = 0; i < N_CBIDS; i++) {
        rl_cbid_t c = {CBIDS[i].domain, CBIDS[i].cbid, CBIDS[i].category, (uint32_t)strlen(CBIDS[i].name)};
        put(m, &c, sizeof c);
        put(m, CBIDS[i].name, c.name_len);
        pad8(m);
    }
    frame_end(m);
}

uint32_t g_names_sent; /* names already sent on the current connection (sender thread only) */

int build_batch(outmsg_t *m, slot_t *s) {
    frame_begin(m, RL_MSG_BATCH);
    rl_batch_t b;
    memset(&b, 0, sizeof b);
    b.pid = (uint32_t)g_pid;
    b.cupti_version = g_cupti_version;
    b.seq = s->seq;
    b.mode = (uint32_t)atomic_load(&g_mode);
    b.flags = atomic_load(&g_flags);
    b.kernel_sample_every = atomic_load(&g_sample_every);
    b.n_devices = s->n_devices;
    b.n_sections = s->n_sections;
    b.records = s->records;
    b.dropped_cupti = atomic_load(&K.dropped_cupti);
    b.dropped_pool_full = atomic_load(&K.dropped_pool_full);
    b.dropped_no_agent = atomic_load(&K.dropped_no_agent);
    b.dropped_send = atomic_load(&K.dropped_send);
    b.sampled_out = atomic_load(&K.sampled_out);
    b.names_dropped = atomic_load(&K.names_dropped);
    b.walk_errors = atomic_load(&K.walk_errors);
    memcpy(b.device_ids, s->devices, sizeof b.device_ids);
    size_t hdr_at = m->len;
    if (put(m, &b, sizeof b)) return -1;
    pthread_mutex_lock(&g_names_lock);
    uint32_t upto = g_names_count;
    for (uint32_t i = g_names_sent; i < upto; i++) {
        name_ent_t *e = &g_names[g_name_order[i]];
        rl_name_t n = {(uint64_t)e->ptr, e->len, 0};
        if (put(m, &n, sizeof n) || put(m, g_strings + e->off, e->len) || pad8(m)) {
            pthread_mutex_unlock(&g_names_lock);
            return -1;
        }
    }
    pthread_mutex_unlock(&g_names_lock);
    uint32_t n_names = upto - g_names_sent;
    memcpy(m->buf + hdr_at + offsetof(rl_batch_t, n_names), &n_names, 4);
    if (put(m, s->data, s->used)) return -1;
    frame_end(m);
    m->records = s->records;
    g_names_sent = upto; /* if this message is later abandoned the connection is closed and all names resent */
    return 0;
}

/* Timestamps of a registered CUPTI timestamp source, mapped to CLOCK_REALTIME (see
 * ridgeline_cupti_guest.c). Pure: tested through the library. */
#ifndef RIDGELINE_CUPTI_GUEST_H
#define RIDGELINE_CUPTI_GUEST_H
#include <stdint.h>

/* 1e18 ns of CLOCK_REALTIME is 2001-09-09: a CUPTI timestamp below it is not CLOCK_REALTIME
 * nanoseconds but a tick of another source (Kineto's __rdtsc: uptime x TSC frequency, about
 * 1e15 after days of uptime; 1e18 would take 10 years at 3 GHz). */
#define RL_NS_FLOOR 1000000000000000000ull

typedef struct {
    int valid;
    uint64_t base_tick;  /* the first pair after the source appeared */
    int64_t base_rt;
    uint64_t anchor_tick; /* the latest pair */
    int64_t anchor_rt;
    double ns_per_tick;   /* over base .. anchor */
} rl_clock_map_t;

/* CLOCK_REALTIME ns of tick t: linear through the latest pair with the long-baseline scale. */
static inline uint64_t rl_clock_map(const rl_clock_map_t *m, uint64_t t) {
    double d = (double)(int64_t)(t - m->anchor_tick) * m->ns_per_tick;
    int64_t v = m->anchor_rt + (int64_t)d;
    return v > 0 ? (uint64_t)v : 0;
}
#endif

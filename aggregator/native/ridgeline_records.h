/* Record readers shared by ridgeline_fold.c and ridgeline_map.c: the batch's structured
 * records (probes/events.py: packed, so an int64 field of record i is aligned only for some i,
 * and numpy's strided loops over it are several times slower than one pass in C). base: the
 * first record; stride: bytes between records; off: the field's byte offset. */
#ifndef RIDGELINE_RECORDS_H
#define RIDGELINE_RECORDS_H
#include <stdint.h>
#include <string.h>

static inline int64_t rd64(const char *base, int64_t stride, int64_t i, int64_t off) {
    int64_t v;
    memcpy(&v, base + i * stride + off, sizeof v);
    return v;
}

static inline int32_t rd32(const char *base, int64_t stride, int64_t i, int64_t off) {
    int32_t v;
    memcpy(&v, base + i * stride + off, sizeof v);
    return v;
}
#endif

/* Writes CUPTI activity records laid out by a real CUPTI header set (tests/test_cupti_layouts.py).
 *
 * Compiled once per header set with the struct versions that release's libcupti writes
 * (the newest of each kind its headers define, picked by the test from the header text):
 *   cc -I<wheel>/include -DKERNEL_T=CUpti_ActivityKernel9 -DMEMCPY_T=CUpti_ActivityMemcpy6
 *      -DMEMSET_T=CUpti_ActivityMemset4 cupti_header_records.c
 * Every record is filled through the header's own types with designated initialisers, so
 * the bytes are where that release's compiler-visible layout puts them; nothing here
 * knows an offset. Input (stdin), one record per line:
 *   K start end device context stream gx gy gz bx by bz regs sshm dshm corr name graphnode graphid
 *   C copykind bytes start end device context stream corr graphnode graphid
 *   S value bytes start end device context stream corr graphnode graphid
 *   A kind cbid start end pid tid corr
 *   X externalkind externalid corr
 *   M flags timestamp id pid tid name domain
 *   G start end device graph context stream corr            (CUpti_ActivityGraphTrace2)
 * Output (argv[1]): per kind, u32 kind, u32 sizeof(record), u32 count, then the records;
 * stdout: "api_version <CUPTI_API_VERSION>".
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cupti_activity.h>
#include <cupti_version.h>

typedef struct { uint32_t kind, size, count; unsigned char *data; size_t cap; } section_t;

static void add(section_t *s, uint32_t kind, const void *rec, size_t size) {
    if (s->count == 0) { s->kind = kind; s->size = (uint32_t)size; }
    if ((size_t)(s->count + 1) * size > s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64 * size;
        s->data = realloc(s->data, s->cap);
        if (!s->data) exit(3);
    }
    memcpy(s->data + (size_t)s->count * size, rec, size);
    s->count++;
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s OUT < records\n", argv[0]); return 2; }
    section_t sec[8] = {0};
    char tag[4];
    while (scanf("%3s", tag) == 1) {
        uint64_t a[20] = {0};
        int n = tag[0] == 'K' ? 18 : tag[0] == 'C' || tag[0] == 'S' ? 10 : tag[0] == 'A' ? 7
              : tag[0] == 'X' ? 3 : tag[0] == 'M' ? 7 : tag[0] == 'G' ? 7 : -1;
        if (n < 0) { fprintf(stderr, "bad tag %s\n", tag); return 2; }
        for (int i = 0; i < n; i++)
            if (scanf("%" SCNu64, &a[i]) != 1) { fprintf(stderr, "short line for %s\n", tag); return 2; }
        if (tag[0] == 'K') {
            KERNEL_T r = {.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, .start = a[0], .end = a[1],
                          .deviceId = (uint32_t)a[2], .contextId = (uint32_t)a[3], .streamId = (uint32_t)a[4],
                          .gridX = (int32_t)a[5], .gridY = (int32_t)a[6], .gridZ = (int32_t)a[7],
                          .blockX = (int32_t)a[8], .blockY = (int32_t)a[9], .blockZ = (int32_t)a[10],
                          .registersPerThread = (uint16_t)a[11], .staticSharedMemory = (int32_t)a[12],
                          .dynamicSharedMemory = (int32_t)a[13], .correlationId = (uint32_t)a[14],
                          .name = (const char *)(uintptr_t)a[15], .graphNodeId = a[16], .graphId = (uint32_t)a[17]};
            add(&sec[0], r.kind, &r, sizeof r);
        } else if (tag[0] == 'C') {
            MEMCPY_T r = {.kind = CUPTI_ACTIVITY_KIND_MEMCPY, .copyKind = (uint8_t)a[0], .bytes = a[1],
                          .start = a[2], .end = a[3], .deviceId = (uint32_t)a[4], .contextId = (uint32_t)a[5],
                          .streamId = (uint32_t)a[6], .correlationId = (uint32_t)a[7], .graphNodeId = a[8],
                          .graphId = (uint32_t)a[9]};
            add(&sec[1], r.kind, &r, sizeof r);
        } else if (tag[0] == 'S') {
            MEMSET_T r = {.kind = CUPTI_ACTIVITY_KIND_MEMSET, .value = (uint32_t)a[0], .bytes = a[1],
                          .start = a[2], .end = a[3], .deviceId = (uint32_t)a[4], .contextId = (uint32_t)a[5],
                          .streamId = (uint32_t)a[6], .correlationId = (uint32_t)a[7], .graphNodeId = a[8],
                          .graphId = (uint32_t)a[9]};
            add(&sec[2], r.kind, &r, sizeof r);
        } else if (tag[0] == 'A') {
            CUpti_ActivityAPI r = {.kind = (CUpti_ActivityKind)a[0], .cbid = (CUpti_CallbackId)a[1], .start = a[2],
                                   .end = a[3], .processId = (uint32_t)a[4], .threadId = (uint32_t)a[5],
                                   .correlationId = (uint32_t)a[6]};
            add(&sec[a[0] == CUPTI_ACTIVITY_KIND_DRIVER ? 3 : 4], r.kind, &r, sizeof r);
        } else if (tag[0] == 'X') {
            CUpti_ActivityExternalCorrelation r = {.kind = CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION,
                                                   .externalKind = (CUpti_ExternalCorrelationKind)a[0],
                                                   .externalId = a[1], .correlationId = (uint32_t)a[2]};
            add(&sec[5], r.kind, &r, sizeof r);
        } else if (tag[0] == 'G') {
            CUpti_ActivityGraphTrace2 r = {.kind = CUPTI_ACTIVITY_KIND_GRAPH_TRACE, .start = a[0], .end = a[1],
                                           .deviceId = (uint32_t)a[2], .graphId = (uint32_t)a[3],
                                           .contextId = (uint32_t)a[4], .streamId = (uint32_t)a[5],
                                           .correlationId = (uint32_t)a[6]};
            add(&sec[7], r.kind, &r, sizeof r);
        } else {
            CUpti_ActivityMarker2 r = {.kind = CUPTI_ACTIVITY_KIND_MARKER, .flags = (CUpti_ActivityFlag)a[0],
                                       .timestamp = a[1], .id = (uint32_t)a[2],
                                       .objectKind = CUPTI_ACTIVITY_OBJECT_THREAD,
                                       .objectId.pt.processId = (uint32_t)a[3], .objectId.pt.threadId = (uint32_t)a[4],
                                       .name = (const char *)(uintptr_t)a[5], .domain = (const char *)(uintptr_t)a[6]};
            add(&sec[6], r.kind, &r, sizeof r);
        }
    }
    FILE *f = fopen(argv[1], "wb");
    if (!f) { perror(argv[1]); return 2; }
    for (int i = 0; i < 8; i++) {
        if (!sec[i].count) continue;
        uint32_t h[3] = {sec[i].kind, sec[i].size, sec[i].count};
        fwrite(h, sizeof h, 1, f);
        fwrite(sec[i].data, sec[i].size, sec[i].count, f);
    }
    fclose(f);
    printf("api_version %d\n", (int)CUPTI_API_VERSION);
    return 0;
}

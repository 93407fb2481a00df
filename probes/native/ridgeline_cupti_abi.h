/* What libridgeline_cupti.so relies on in CUPTI's binary interface, written down once so
 * the library builds against the CUPTI headers of any CUDA 12.x or 13.x release.
 *
 * Why not the headers' own types: the newest record structs (CUpti_ActivityKernel13,
 * Memcpy7, Memset5) and the multi-subscriber API types (CUpti_SubscriberParams with
 * allowMultipleSubscribers, the _v2 buffer callbacks, CUpti_ActivityConfig) exist only in
 * recent headers, while served processes run whatever libcupti torch or the toolkit
 * brought. So:
 *  - record fields are read at fixed offsets. Every field below sits at the same offset
 *    in every kernel record layout from CUpti_ActivityKernel4 (CUDA 11) to Kernel13
 *    (CUDA 13.5), every memcpy/memset layout and Marker2; tests/test_native_cupti_headers.py
 *    checks this table against offsetof() compiled with each real header set, and the
 *    library static-asserts it against the header it is built with;
 *  - the name pointer of a kernel record is dereferenced only when the record's size is
 *    one of RL_KERNEL_KNOWN_SIZES (a layout whose name offset is known), never at a
 *    guessed offset inside a record of unknown layout;
 *  - the _v2 entry points are dlsym'ed and called through the local types below (same
 *    layout as the 13.2+ headers, static-asserted when the header has them).
 */
#ifndef RIDGELINE_CUPTI_ABI_H
#define RIDGELINE_CUPTI_ABI_H
#include <stddef.h>
#include <stdint.h>

/* ---- record field offsets (bytes from the start of the record) ---- */
#define RL_REC_OFF_KIND 0               /* CUpti_ActivityKind, int32, every record */
#define RL_KERNEL_OFF_DEVICE_ID 40      /* CUpti_ActivityKernelN.deviceId, uint32 */
#define RL_KERNEL_OFF_NAME 104          /* CUpti_ActivityKernelN.name, const char * */
#define RL_MEMCPY_OFF_DEVICE_ID 32      /* CUpti_ActivityMemcpyN.deviceId, uint32 */
#define RL_MEMSET_OFF_DEVICE_ID 32      /* CUpti_ActivityMemsetN.deviceId, uint32 */
#define RL_MARKER_OFF_NAME 40           /* CUpti_ActivityMarker2.name, const char * */
#define RL_MARKER_OFF_DOMAIN 48         /* CUpti_ActivityMarker2.domain, const char * */
#define RL_MARKER_MIN_SIZE 56           /* sizeof(CUpti_ActivityMarker2) */

/* Kernel record sizes whose layout is known (Kernel8 .. Kernel13: CUDA 11.8 .. 13.5+):
 * only in these is the name pointer read. */
#define RL_KERNEL_KNOWN_SIZES {200, 208, 216, 224, 232, 248}

/* The largest record the buffer walk accepts (CUPTI's largest activity record is well
 * under 1 KiB); anything bigger is a walk error, not a record. */
#define RL_MAX_RECORD_BYTES 1024

/* ---- the multi-subscriber (_v2) interface, CUPTI >= 13.2 ---- */
#define RL_OLD_SUBSCRIBER_NAME_MIN_LEN 64
#define RL_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE 12 /* CUPTI_ACTIVITY_ATTR_MULTIPLE_SUBSCRIBER_STATE */

typedef struct {
    size_t structSize;
    const char *subscriberName;
    char *oldSubscriberName;
    size_t oldSubscriberSize;
    uint8_t allowMultipleSubscribers;
    uint8_t padding[7];
} rl_subscriber_params_t; /* = CUpti_SubscriberParams of 13.2+ */

typedef void (*rl_buffer_request2_fn)(uint8_t **buffer, size_t *size, size_t *max_records, void *request_info);
typedef void (*rl_buffer_complete2_fn)(uint8_t *buffer, size_t size, size_t valid_size, void *complete_info);

#endif

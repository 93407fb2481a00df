/* Minimal stand-in for the CUDA driver header, used only so the CUPTI headers
 * (cupti_activity.h, cupti_callbacks.h) compile without a CUDA toolkit: the
 * nvidia-cuda-cupti wheel ships the CUPTI headers but not cuda.h.
 *
 * Why this is safe: the injection library never calls the driver and never links
 * libcuda; it only needs the *layout* of CUPTI activity records. Every CUDA type
 * that appears inside a record we read is an opaque pointer or a 32-bit enum, and
 * ridgeline_cupti.c static-asserts the offsets it reads (ridgeline_cupti_abi.h) against
 * the header it is built with (tests/test_native_cupti_headers.py checks them against the
 * headers of several CUDA releases).
 */
#ifndef RIDGELINE_COMPAT_CUDA_H
#define RIDGELINE_COMPAT_CUDA_H
#include <stdint.h>
#include <stddef.h>
#define CUDA_VERSION 13000
typedef int CUdevice;
typedef int CUresult;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef struct CUaccessPolicyWindow_st CUaccessPolicyWindow;
typedef enum { CU_GRAPH_NODE_TYPE_KERNEL_ = 0 } CUgraphNodeType;
typedef enum { CU_DEVICE_ATTRIBUTE_DUMMY_ = 0 } CUdevice_attribute;
typedef enum { CU_STREAM_ATTRIBUTE_DUMMY_ = 0 } CUstreamAttrID;
typedef union CUstreamAttrValue_u { char pad[64]; } CUstreamAttrValue;
#endif

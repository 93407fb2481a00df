"""What pynvml hands back for an H200 serving vLLM, as pynvml's own structures
(tests/test_nvml.py, tests/test_device_metrics.py).
"""
import pynvml

from ridgeline.probes import nvml

ENGINE_PID, OTHER_PID = 48213, 51077


H200_TOTAL = 150_754_820_096          # 143,771 MiB as NVML reports an H200 141 GB


H200_RESERVED = 599_785_472


H200_USED = 135_679_082_496           # vLLM at gpu_memory_utilization=0.9


def h200_raw(gpm=True, mask=0x4):
    mem = pynvml.c_nvmlMemory_v2_t()
    mem.version = pynvml.nvmlMemory_v2
    mem.total, mem.reserved, mem.used = H200_TOTAL, H200_RESERVED, H200_USED
    mem.free = H200_TOTAL - H200_RESERVED - H200_USED
    util = pynvml.c_nvmlUtilization_t()
    util.gpu, util.memory = 100, 38
    p1 = pynvml.c_nvmlProcessInfo_v3_t()
    p1.pid, p1.usedGpuMemory = ENGINE_PID, 135_141_163_008
    p2 = pynvml.c_nvmlProcessInfo_v3_t()
    p2.pid, p2.usedGpuMemory = OTHER_PID, 0
    procs = [pynvml.nvmlStructToFriendlyObject(p1), pynvml.nvmlStructToFriendlyObject(p2)]
    procs[1].usedGpuMemory = None          # what pynvml hands back for "not available"
    fields = (pynvml.c_nvmlFieldValue_t * 2)()
    fields[0].fieldId, fields[0].scopeId = nvml.FI_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF
    fields[0].valueType, fields[0].nvmlReturn = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0
    fields[0].value.ullVal = 7_340_032        # KiB since load
    fields[1].fieldId, fields[1].scopeId = nvml.FI_NVLINK_THROUGHPUT_DATA_RX, 0xFFFFFFFF
    fields[1].valueType, fields[1].nvmlReturn = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, pynvml.NVML_ERROR_NOT_SUPPORTED
    metrics = []
    for mid, val in ((10, 78.5), (3, 41.2), (5, 12.0), (7, 11.5), (12, 3.1), (13, 0.4), (2, 99.0), (60, 2048.0)):
        m = pynvml.c_nvmlGpmMetric_t()
        m.metricId, m.nvmlReturn, m.value = mid, 0, val
        metrics.append(m)
    bad = pynvml.c_nvmlGpmMetric_t()
    bad.metricId, bad.nvmlReturn, bad.value = 11, pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0
    metrics.append(bad)
    return {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-5a1c2f6e-0d1b-4c3e-9f00-112233445566",
            "ts_ns": 1_764_500_000_000_000_000, "memory": mem, "processes": procs, "utilization": util,
            "sm_clock_mhz": 1755, "mem_clock_mhz": 3201, "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 3201,
            "clock_event_reasons": mask, "power_mw": 612_345, "power_limit_mw": 700_000,
            "energy_mj": 9_876_543_210, "temperature_c": 61, "pcie_tx_kbps": 1_234, "pcie_rx_kbps": 56_789,
            "nvlink_fields": fields, "gpm": metrics if gpm else None, "gpm_interval_ns": 1_000_000_000}

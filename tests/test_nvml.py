"""NVML probe: pure decoding from NVML structures (pynvml's own ctypes types filled with
realistic H200 values), the real no-driver path, and the sampler's bookkeeping."""
import ctypes
import time
import types

import pynvml
import pytest
from support.nvml_samples import ENGINE_PID, H200_RESERVED, H200_TOTAL, H200_USED, OTHER_PID, h200_raw

from ridgeline.probes import nvml


def test_device_record_h200_literals():
    r = nvml.device_record(h200_raw())
    assert r["gpu_name"] == "NVIDIA H200" and r["gpu_index"] == 0
    assert r["memory_total_bytes"] == H200_TOTAL and r["memory_reserved_bytes"] == H200_RESERVED
    assert r["memory_used_bytes"] == H200_USED
    assert r["memory_free_bytes"] == H200_TOTAL - H200_RESERVED - H200_USED
    assert r["processes"] == [{"pid": ENGINE_PID, "gpu_memory_used_bytes": 135_141_163_008},
                              {"pid": OTHER_PID, "gpu_memory_used_bytes": None}]
    # Busy-time fractions, named as such.
    assert r["gpu_busy_time_pct"] == 100.0 and r["memory_busy_time_pct"] == 38.0
    assert "gpu_util_pct" not in r
    assert (r["sm_clock_mhz"], r["sm_clock_max_mhz"], r["mem_clock_mhz"]) == (1755, 1980, 3201)
    assert r["clock_event_reasons"] == ["sw_power_cap"] and r["clock_slowdown"] is True
    assert r["power_w"] == pytest.approx(612.345) and r["power_limit_w"] == 700.0
    assert r["energy_total_j"] == pytest.approx(9_876_543.21)
    assert r["temperature_c"] == 61
    assert r["pcie_tx_bytes_per_s"] == 1_234 * 1024 and r["pcie_rx_bytes_per_s"] == 56_789 * 1024
    assert r["nvlink_tx_total_bytes"] == 7_340_032 * 1024 and r["nvlink_rx_total_bytes"] is None
    assert r["gpm_dram_bw_util_pct"] == 78.5 and r["gpm_sm_occupancy_pct"] == 41.2
    assert r["gpm_any_tensor_util_pct"] == 12.0 and r["gpm_hmma_tensor_util_pct"] == 11.5
    assert r["gpm_fp32_util_pct"] == 3.1 and r["gpm_fp16_util_pct"] == 0.4
    assert r["gpm_fp64_util_pct"] is None            # that metric returned NOT_SUPPORTED
    assert r["gpm_nvlink_rx_bytes_per_s"] == 2048.0 * 1024 * 1024
    assert r["source"] == "nvml+gpm"


def test_device_record_pre_hopper_and_v1_memory():
    raw = h200_raw(gpm=False, mask=0x1)
    mem = pynvml.c_nvmlMemory_t()
    mem.total, mem.used, mem.free = 85_899_345_920, 1_048_576, 85_898_297_344   # A100 80GB, idle
    raw["memory"] = mem
    raw["processes"] = []
    r = nvml.device_record(raw)
    assert r["memory_reserved_bytes"] is None        # unknown, not 0
    assert r["gpm_dram_bw_util_pct"] is None and r["source"] == "nvml"
    assert r["clock_event_reasons"] == ["gpu_idle"] and r["clock_slowdown"] is False
    assert r["processes"] == []


def test_device_record_all_unsupported():
    r = nvml.device_record({"index": 3})
    assert r["gpu_index"] == 3 and r["memory_total_bytes"] is None and r["processes"] is None
    assert r["clock_event_reasons"] is None and r["power_w"] is None


@pytest.mark.parametrize("mask,names", [
    (0, []),
    (0x1, ["gpu_idle"]),
    (0x4 | 0x20 | 0x40, ["sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown"]),
    (0x8 | 0x80, ["hw_slowdown", "hw_power_brake_slowdown"]),
    (0x800 | 0x1, ["gpu_idle", "bit_0x800"]),
])
def test_clock_event_reasons(mask, names):
    assert nvml.decode_clock_event_reasons(mask) == names


def test_clock_reason_bits_match_pynvml():
    for bit, name in nvml.CLOCK_EVENT_REASONS.items():
        camel = "".join(w.capitalize() for w in name.split("_")).replace("Sw", "Sw").replace("Hw", "Hw")
        cand = [n for n in dir(pynvml) if n.startswith("nvmlClocksThrottleReason") and
                n.lower().endswith(camel.lower())]
        assert cand, name
        assert getattr(pynvml, cand[0]) == bit


def test_gpm_ids_match_pynvml():
    expect = {"gpm_sm_util_pct": "SM_UTIL", "gpm_sm_occupancy_pct": "SM_OCCUPANCY",
              "gpm_any_tensor_util_pct": "ANY_TENSOR_UTIL", "gpm_hmma_tensor_util_pct": "HMMA_TENSOR_UTIL",
              "gpm_dram_bw_util_pct": "DRAM_BW_UTIL", "gpm_fp64_util_pct": "FP64_UTIL",
              "gpm_fp32_util_pct": "FP32_UTIL", "gpm_fp16_util_pct": "FP16_UTIL",
              "gpm_pcie_tx_bytes_per_s": "PCIE_TX_PER_SEC", "gpm_pcie_rx_bytes_per_s": "PCIE_RX_PER_SEC",
              "gpm_nvlink_rx_bytes_per_s": "NVLINK_TOTAL_RX_PER_SEC",
              "gpm_nvlink_tx_bytes_per_s": "NVLINK_TOTAL_TX_PER_SEC"}
    for mid, key in nvml.GPM_METRICS.items():
        assert getattr(pynvml, "NVML_GPM_METRIC_" + expect[key]) == mid
    assert nvml.FI_NVLINK_THROUGHPUT_DATA_TX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX


def _driver_present():
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


def test_check_without_driver_gives_reason_and_hint():
    if _driver_present():
        pytest.skip("libnvidia-ml.so.1 is present: the no-driver path cannot be observed here")
    av = nvml.NvmlProbe().check()
    assert not av.ok
    assert av.reason == "NVML: NVML Shared Library Not Found"
    assert "no NVIDIA driver" in av.hint


@pytest.mark.parametrize("value,text,hint", [
    (9, "Driver Not Loaded", "kernel module"),
    (4, "Insufficient Permissions", "/dev/nvidia"),
    (999, "Unknown Error", "nvidia-smi"),
])
def test_error_availability(value, text, hint):
    exc = pynvml.NVMLError(value)
    av = nvml.nvml_error_availability(exc)
    assert not av.ok and av.reason.startswith("NVML: ") and hint in av.hint


def test_interval_minimum():
    assert nvml.NvmlProbe().interval_s == 1.0
    assert nvml.NvmlProbe(interval_s=0.1).interval_s == 0.1
    with pytest.raises(ValueError, match="minimum"):
        nvml.NvmlProbe(interval_s=0.05)


def _fake_nvml(raw):
    """A pynvml-shaped namespace returning ``raw``'s values; unsupported calls raise NVMLError."""
    def unsupported(*a):
        raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)

    clocks = {(pynvml.NVML_CLOCK_SM,): raw["sm_clock_mhz"], (pynvml.NVML_CLOCK_MEM,): raw["mem_clock_mhz"]}
    return types.SimpleNamespace(
        NVMLError=pynvml.NVMLError, nvmlMemory_v2=pynvml.nvmlMemory_v2, NVML_CLOCK_SM=pynvml.NVML_CLOCK_SM,
        NVML_CLOCK_MEM=pynvml.NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU=pynvml.NVML_TEMPERATURE_GPU,
        NVML_PCIE_UTIL_TX_BYTES=pynvml.NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES=pynvml.NVML_PCIE_UTIL_RX_BYTES,
        nvmlDeviceGetName=lambda h: raw["name"], nvmlDeviceGetUUID=lambda h: raw["uuid"],
        nvmlDeviceGetMemoryInfo=lambda h, v=None: raw["memory"],
        nvmlDeviceGetComputeRunningProcesses=lambda h: raw["processes"],
        nvmlDeviceGetUtilizationRates=lambda h: raw["utilization"],
        nvmlDeviceGetClockInfo=lambda h, t: clocks[(t,)], nvmlDeviceGetMaxClockInfo=unsupported,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: raw["clock_event_reasons"],
        nvmlDeviceGetPowerUsage=lambda h: raw["power_mw"], nvmlDeviceGetEnforcedPowerLimit=unsupported,
        nvmlDeviceGetTotalEnergyConsumption=lambda h: raw["energy_mj"],
        nvmlDeviceGetTemperature=lambda h, s: raw["temperature_c"],
        nvmlDeviceGetPcieThroughput=lambda h, c: raw["pcie_tx_kbps"] if c == 0 else raw["pcie_rx_kbps"],
        nvmlDeviceGetFieldValues=unsupported,
        nvmlDeviceGetTotalEccErrors=unsupported, nvmlDeviceGetRetiredPages=unsupported,
        nvmlDeviceGetRetiredPagesPendingStatus=unsupported, nvmlDeviceGetRemappedRows=unsupported,
        nvmlEventSetCreate=unsupported,
    )


def test_read_device_glue_tolerates_unsupported_calls():
    raw = h200_raw()
    got = nvml.read_device(_fake_nvml(raw), object(), 0, gpm_state={"supported": False})
    assert got["sm_clock_max_mhz"] is None and got["power_limit_mw"] is None and got["nvlink_fields"] is None
    r = nvml.device_record(got)
    assert r["memory_used_bytes"] == H200_USED and r["power_w"] == pytest.approx(612.345)
    assert r["gpm_dram_bw_util_pct"] is None and r["source"] == "nvml"


def test_sampler_queue_is_bounded_and_counts_drops():
    p = nvml.NvmlProbe(max_queued=3)
    p._nv = _fake_nvml(h200_raw())
    p._handles = [object(), object()]
    p._gpm_state = [{"supported": False}, {"supported": False}]
    p.sample_once()
    p.sample_once()
    c = p.counters()
    assert c["records"] == 4 and c["drops"] == 1
    out = p.poll()
    assert [r["gpu_index"] for r in out["devices"]] == [1, 0, 1]
    assert p.poll() is None
    p._nv = None
    p.stop()
    p.stop()


@pytest.mark.gpu
def test_real_gpu_sampling():
    p = nvml.NvmlProbe(interval_s=0.1)
    assert p.check().ok
    p.start()
    try:
        time.sleep(0.5)
        out = p.poll()
    finally:
        p.stop()
    recs = out["devices"]
    assert recs and recs[0]["memory_total_bytes"] > 0 and recs[0]["gpu_busy_time_pct"] is not None
    assert recs[0]["sm_clock_mhz"] > 0 and recs[0]["clock_event_reasons"] is not None


def test_gpm_step_pairs_consecutive_samples_and_frees_them():
    """The GPM glue with pynvml's real metrics-get structure; the NVML calls are lookalikes."""
    freed, allocated = [], []

    def alloc():
        s = pynvml.c_nvmlGpmSample_t(pynvml.struct_c_nvmlGpmSample_t())
        allocated.append(s)
        return s

    def metrics_get(mg):
        assert mg.version == pynvml.NVML_GPM_METRICS_GET_VERSION and mg.numMetrics == len(nvml.GPM_METRICS)
        for i in range(mg.numMetrics):
            mg.metrics[i].nvmlReturn = 0
            mg.metrics[i].value = {10: 81.0, 3: 44.0}.get(mg.metrics[i].metricId, 1.0)
        return mg

    nv = _fake_nvml(h200_raw())
    nv.nvmlGpmSampleAlloc = alloc
    nv.nvmlGpmSampleGet = lambda h, s: None
    nv.nvmlGpmSampleFree = freed.append
    nv.c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    nv.NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    nv.nvmlGpmMetricsGet = metrics_get
    state = {"supported": True}
    first = nvml.read_device(nv, object(), 0, state)
    assert first["gpm"] is None                      # one sample: no interval yet
    second = nvml.device_record(nvml.read_device(nv, object(), 0, state))
    assert second["gpm_dram_bw_util_pct"] == 81.0 and second["gpm_sm_occupancy_pct"] == 44.0
    assert second["gpm_interval_ns"] > 0 and second["source"] == "nvml+gpm"
    assert freed == [allocated[0]] and state["sample"] is allocated[1]


def test_probe_lifecycle_on_interval(monkeypatch):
    """start() -> sampler thread at the interval -> poll() drains -> stop() shuts NVML down."""
    nv = _fake_nvml(h200_raw())
    calls = []

    def unsupported(*a):
        raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nv.nvmlInit = lambda: calls.append("init")
    nv.nvmlShutdown = lambda: calls.append("shutdown")
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nv.nvmlGpmQueryDeviceSupport = unsupported
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: nv)
    p = nvml.NvmlProbe(interval_s=0.1)
    assert p.check().ok and p.check().reason == "NVML: 2 GPU(s)"
    p.start()
    try:
        time.sleep(0.55)
    finally:
        p.stop()
        p.stop()
    recs = p.poll()["devices"]
    per_gpu = [sum(1 for r in recs if r["gpu_index"] == i) for i in (0, 1)]
    assert 3 <= per_gpu[0] <= 8 and per_gpu[0] == per_gpu[1]      # about 0.55 s / 0.1 s samples each
    assert all(r["source"] == "nvml" for r in recs)                 # GPM unsupported: plain NVML
    assert calls.count("shutdown") == calls.count("init") == 3        # check() twice, start() once


# --------------------------------------------------------------------------- memory health, Xid

def test_health_ids_match_pynvml():
    """The ECC, page-retirement and event numbers are nvml.h's (NVIDIA/go-nvml
    gen/nvml/nvml.h lines 1073-1098, 1355-1356, 3168, 1308), as pynvml transcribes them."""
    assert nvml.ECC_COUNTERS == {
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): "ecc_corrected_volatile_errors_total",
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): "ecc_uncorrected_volatile_errors_total",
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): "ecc_corrected_aggregate_errors_total",
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC):
            "ecc_uncorrected_aggregate_errors_total"}
    assert set(nvml.RETIREMENT_CAUSES) == {pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                                           pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR}
    assert nvml.RETIREMENT_CAUSES[pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR] == \
        "retired_pages_double_bit_count"
    assert nvml.EVENT_TYPE_XID_CRITICAL_ERROR == pynvml.nvmlEventTypeXidCriticalError
    assert nvml.NVML_ERROR_TIMEOUT == pynvml.NVML_ERROR_TIMEOUT


def test_decode_health_an_ampere_with_remapped_rows_and_an_xid():
    raw = {"ecc_counts": {(0, 0): 12, (1, 0): 0, (0, 1): 340, (1, 1): 2},
           "retired_pages": {0: None, 1: None},          # retired pages: pre-Ampere only
           "retired_pages_pending": None,
           "remapped_rows": (3, 1, 0, 0), "xids": [79]}
    assert nvml.decode_health(raw) == {
        "ecc_corrected_volatile_errors_total": 12, "ecc_uncorrected_volatile_errors_total": 0,
        "ecc_corrected_aggregate_errors_total": 340, "ecc_uncorrected_aggregate_errors_total": 2,
        "retired_pages_single_bit_count": None, "retired_pages_double_bit_count": None,
        "retired_pages_pending": None, "remapped_rows_correctable_count": 3, "remapped_rows_uncorrectable_count": 1,
        "remapped_rows_pending": False, "remapped_rows_failed": False, "xid_errors_count": 1, "xid_errors": [79]}


def test_decode_health_a_volta_with_retired_pages_pending():
    raw = {"ecc_counts": {}, "retired_pages": {0: [0x1A000, 0x2B000], 1: [0x3C000]},
           "retired_pages_pending": pynvml.NVML_FEATURE_ENABLED, "remapped_rows": None, "xids": []}
    r = nvml.decode_health(raw)
    assert (r["retired_pages_single_bit_count"], r["retired_pages_double_bit_count"]) == (2, 1)
    assert r["retired_pages_pending"] is True and r["remapped_rows_failed"] is None
    assert r["ecc_uncorrected_volatile_errors_total"] is None        # ECC unsupported: unknown, never 0
    assert (r["xid_errors_count"], r["xid_errors"]) == (0, [])


def test_decode_health_unsupported_everywhere_is_unknown_not_zero():
    r = nvml.decode_health({})
    assert set(r.values()) == {None}
    assert nvml.device_record({"index": 0})["xid_errors"] is None


def test_decode_xid_events_keeps_order_and_drops_other_events():
    events = [(0, pynvml.nvmlEventTypeXidCriticalError, 79), (1, pynvml.nvmlEventTypeXidCriticalError, 48),
              (0, pynvml.nvmlEventTypePState, 0), (0, pynvml.nvmlEventTypeXidCriticalError, nvml.XID_UNKNOWN)]
    assert nvml.decode_xid_events(events) == {0: [79, 999], 1: [48]}


def test_decode_health_bounds_the_xids_kept():
    r = nvml.decode_health({"xids": list(range(100))})
    assert r["xid_errors_count"] == 100 and r["xid_errors"] == list(range(100 - nvml.MAX_XIDS_PER_SAMPLE, 100))


class _Event:
    def __init__(self, device, etype, data):
        self.device, self.eventType, self.eventData = device, etype, data


def test_drain_xid_events_until_timeout_and_sampler_attaches_them():
    """The glue: drain without waiting until NVML says TIMEOUT, name each event's device by
    its index; the sampler gives each device record its own Xids (and [] where none came)."""
    queue = [_Event("h1", pynvml.nvmlEventTypeXidCriticalError, 79), _Event("h0", pynvml.nvmlEventTypeXidCriticalError, 13)]
    nv = _fake_nvml(h200_raw())

    def wait(evset, timeout_ms):
        assert timeout_ms == 0
        if not queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return queue.pop(0)
    nv.nvmlEventSetWait_v2 = wait
    nv.nvmlDeviceGetIndex = lambda h: int(h[1:])
    assert nvml.drain_xid_events(nv, "set") == [(1, 8, 79), (0, 8, 13)]
    queue[:] = [_Event("h1", pynvml.nvmlEventTypeXidCriticalError, 79)]
    p = nvml.NvmlProbe()
    p._nv, p._handles, p._xid_set = nv, ["h0", "h1"], "set"
    p._gpm_state = [{"supported": False}, {"supported": False}]
    p.sample_once()
    recs = p.poll()["devices"]
    assert [(r["gpu_index"], r["xid_errors"]) for r in recs] == [(0, []), (1, [79])]
    p._xid_set = None                     # no event set (unsupported): unknown, not "no errors"
    p.sample_once()
    assert [r["xid_errors"] for r in p.poll()["devices"]] == [None, None]


def test_drain_xid_events_raises_what_is_not_a_timeout():
    nv = _fake_nvml(h200_raw())

    def wait(evset, timeout_ms):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    nv.nvmlEventSetWait_v2 = wait
    with pytest.raises(pynvml.NVMLError):
        nvml.drain_xid_events(nv, "set")


def test_xid_event_set_none_when_no_device_supports_it():
    nv = _fake_nvml(h200_raw())
    freed = []
    nv.nvmlEventSetCreate = lambda: "set"
    nv.nvmlEventSetFree = freed.append

    def refuse(h, types_, s):
        raise pynvml.NVMLError_NotSupported(pynvml.NVML_ERROR_NOT_SUPPORTED)
    nv.nvmlDeviceRegisterEvents = refuse
    assert nvml.xid_event_set(nv, ["h0"]) is None and freed == ["set"]
    registered = []
    nv.nvmlDeviceRegisterEvents = lambda h, t, s: registered.append((h, t))
    assert nvml.xid_event_set(nv, ["h0", "h1"]) == "set"
    assert registered == [("h0", 8), ("h1", 8)]

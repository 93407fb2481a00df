"""NVML device probe: memory, per-process memory, busy-time, clocks and clock-event reasons,
power and energy, temperature, PCIe and NVLink traffic, and (Hopper and later) GPM metrics.

Two layers, kept apart on purpose:

* :func:`read_device` is the thin glue: read-only NVML calls on one device handle, each
  guarded so that a field the device does not support comes back as ``None`` instead of
  aborting the sample. It returns the NVML values as NVML returns them (ctypes structs,
  ints in NVML units).
* :func:`device_record` (and the smaller ``decode_*`` helpers) is pure: NVML values in,
  one plain dict out, every key carrying its unit. It is what the tests exercise with
  literals shaped like real NVML values.

``pynvml`` is imported lazily so that importing this module never needs it (and the
aggregator may import the pure helpers). No NVML call here changes device state: no
``nvmlDeviceSet*``, no GPM streaming switch, no accounting toggles.

Utilisation from ``nvmlDeviceGetUtilizationRates`` is a *busy-time fraction*: the share
of the sample period in which at least one kernel ran (``gpu``) or device memory was
read or written (``memory``). A GPU "100% utilised" may use a few percent of its SMs or
bandwidth; the keys say ``busy_time`` so nobody reads them as headroom. GPM's
``dram_bw_util_pct`` and ``sm_occupancy_pct`` are the figures that measure use.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Iterable

from .probe import Availability, Probe

log = logging.getLogger("ridgeline.nvml")

#: NVML clock-event ("throttle") reason bits (nvml.h ``nvmlClocksEventReason*``); the
#: names say why the SM clock is below its maximum. Checked against pynvml in the tests.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

#: GPM metric ids (nvml.h ``NVML_GPM_METRIC_*``) -> record key. All are percentages of
#: the sample interval (cycle fractions), except the *_PER_SEC link rates (MiB/s per
#: nvml.h; converted to bytes/s in :func:`decode_gpm`).
GPM_METRICS: dict[int, str] = {
    2: "gpm_sm_util_pct",
    3: "gpm_sm_occupancy_pct",
    5: "gpm_any_tensor_util_pct",
    7: "gpm_hmma_tensor_util_pct",
    10: "gpm_dram_bw_util_pct",
    11: "gpm_fp64_util_pct",
    12: "gpm_fp32_util_pct",
    13: "gpm_fp16_util_pct",
    20: "gpm_pcie_tx_bytes_per_s",
    21: "gpm_pcie_rx_bytes_per_s",
    60: "gpm_nvlink_rx_bytes_per_s",
    61: "gpm_nvlink_tx_bytes_per_s",
}
_GPM_RATE_IDS = {20, 21, 60, 61}
_MIB = 1024 * 1024

#: NVML field ids used (nvml.h): NVLink data throughput, cumulative KiB, all links when
#: scopeId is UINT_MAX.
FI_NVLINK_THROUGHPUT_DATA_TX = 138
FI_NVLINK_THROUGHPUT_DATA_RX = 139
_ALL_LINKS = 0xFFFFFFFF

#: Memory health (nvml.h as in NVIDIA/go-nvml gen/nvml/nvml.h): ``nvmlMemoryErrorType_t``
#: CORRECTED = 0, UNCORRECTED = 1 (lines 1073, 1080); ``nvmlEccCounterType_t`` VOLATILE = 0
#: (reset at driver load), AGGREGATE = 1 (the device's lifetime) (lines 1097-1098);
#: ``nvmlPageRetirementCause_t`` MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0, DOUBLE_BIT_ECC_ERROR = 1
#: (lines 1355-1356). Checked against pynvml in the tests.
ECC_COUNTERS: dict[tuple[int, int], str] = {
    (0, 0): "ecc_corrected_volatile_errors_total",
    (1, 0): "ecc_uncorrected_volatile_errors_total",
    (0, 1): "ecc_corrected_aggregate_errors_total",
    (1, 1): "ecc_uncorrected_aggregate_errors_total",
}
RETIREMENT_CAUSES: dict[int, str] = {0: "retired_pages_single_bit_count", 1: "retired_pages_double_bit_count"}
#: ``nvmlEventTypeXidCriticalError`` (nvml.h line 3168); ``nvmlEventData_t.eventData`` holds
#: the Xid, "set as 999 for unknown Xid error" (lines 3229-3230).
EVENT_TYPE_XID_CRITICAL_ERROR = 0x8
XID_UNKNOWN = 999
#: ``NVML_ERROR_TIMEOUT`` (nvml.h line 1308): ``nvmlEventSetWait_v2`` found no event.
NVML_ERROR_TIMEOUT = 10
#: XIDs kept per device record (the count says how many arrived).
MAX_XIDS_PER_SAMPLE = 16

# nvmlValueType_t -> member of the c_nvmlValue_t union.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

DEFAULT_INTERVAL_S = 1.0
MIN_INTERVAL_S = 0.1
NVML_ARCH_HOPPER = 9


# --------------------------------------------------------------------------- pure decoding

def decode_clock_event_reasons(mask: int | None) -> list[str] | None:
    """Names of the bits set in an NVML clock-event reason mask (unknown bits as ``bit_0xN``)."""
    if mask is None:
        return None
    names = []
    for bit in sorted(CLOCK_EVENT_REASONS):
        if mask & bit:
            names.append(CLOCK_EVENT_REASONS[bit])
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    b = 1
    while unknown:
        if unknown & b:
            names.append(f"bit_{b:#x}")
            unknown &= ~b
        b <<= 1
    return names


def decode_field_value(fv: Any) -> float | int | None:
    """Value of one ``c_nvmlFieldValue_t`` (None when NVML returned an error for it)."""
    if getattr(fv, "nvmlReturn", 0) != 0:
        return None
    member = _VALUE_MEMBER.get(int(fv.valueType))
    if member is None:
        return None
    return getattr(fv.value, member)


def decode_gpm(metrics: Iterable[Any]) -> dict[str, float | None]:
    """GPM metric entries (``metricId``, ``nvmlReturn``, ``value``) -> named figures.

    Percentages stay percentages (0-100, cycle fractions, *not* FLOP/s); link rates are
    converted from MiB/s to bytes/s. A metric whose ``nvmlReturn`` is non-zero is None.
    """
    out: dict[str, float | None] = {}
    for m in metrics:
        key = GPM_METRICS.get(int(m.metricId))
        if key is None:
            continue
        if int(m.nvmlReturn) != 0:
            out[key] = None
            continue
        v = float(m.value)
        out[key] = v * _MIB if int(m.metricId) in _GPM_RATE_IDS else v
    return out


def decode_xid_events(events: Iterable[tuple[int, int, int]]) -> dict[int, list[int]]:
    """``(device index, eventType, eventData)`` triples, as ``nvmlEventSetWait_v2`` returns
    them, -> ``{device index: [Xid, ...]}`` in arrival order (other event types ignored)."""
    out: dict[int, list[int]] = {}
    for index, etype, data in events:
        if int(etype) & EVENT_TYPE_XID_CRITICAL_ERROR:
            out.setdefault(int(index), []).append(int(data))
    return out


def decode_health(raw: dict[str, Any]) -> dict[str, Any]:
    """Memory and error health of one device, as nvidia-smi -q and dcgm-exporter show it:
    ECC error counters (volatile and aggregate), retired pages (pre-Ampere) and remapped
    rows (Ampere and later), and the Xid critical errors since the previous sample.

    ``raw`` keys (None when NVML does not support the call): ``ecc_counts`` ({(error
    type, counter type): count}), ``retired_pages`` ({cause: [page addresses]}),
    ``retired_pages_pending`` (nvmlEnableState_t), ``remapped_rows`` ((correctable,
    uncorrectable, pending, failure) as ``nvmlDeviceGetRemappedRows`` returns),
    ``xids`` ([Xid, ...]).
    """
    rec: dict[str, Any] = {}
    ecc = raw.get("ecc_counts") or {}
    for key, name in ECC_COUNTERS.items():
        v = ecc.get(key)
        rec[name] = None if v is None else int(v)
    pages = raw.get("retired_pages") or {}
    for cause, name in RETIREMENT_CAUSES.items():
        v = pages.get(cause)
        rec[name] = None if v is None else len(v)
    pend = raw.get("retired_pages_pending")
    rec["retired_pages_pending"] = None if pend is None else bool(int(pend))
    rows = raw.get("remapped_rows")
    if rows is None:
        rec.update({"remapped_rows_correctable_count": None, "remapped_rows_uncorrectable_count": None,
                    "remapped_rows_pending": None, "remapped_rows_failed": None})
    else:
        corr, unc, pending, failure = rows
        rec.update({"remapped_rows_correctable_count": int(corr), "remapped_rows_uncorrectable_count": int(unc),
                    "remapped_rows_pending": bool(pending), "remapped_rows_failed": bool(failure)})
    xids = raw.get("xids")
    rec["xid_errors_count"] = None if xids is None else len(xids)
    rec["xid_errors"] = None if xids is None else [int(x) for x in xids[-MAX_XIDS_PER_SAMPLE:]]
    return rec


def _num(v: Any) -> Any:
    return None if v is None else v


def device_record(raw: dict[str, Any]) -> dict[str, Any]:
    """Decode one :func:`read_device` result into a plain record with units in the keys.

    ``raw`` keys (any may be None when NVML did not support the call): ``index``, ``name``,
    ``uuid``, ``ts_ns``, ``memory`` (struct with ``total``/``used``/``free`` and, for v2,
    ``reserved``, bytes), ``processes`` (objects with ``pid``, ``usedGpuMemory`` bytes or
    None), ``utilization`` (``gpu``/``memory`` percent), ``sm_clock_mhz``,
    ``mem_clock_mhz``, ``sm_clock_max_mhz``, ``mem_clock_max_mhz``,
    ``clock_event_reasons`` (bit mask), ``power_mw``, ``power_limit_mw``, ``energy_mj``
    (since driver load), ``temperature_c``, ``pcie_tx_kbps``/``pcie_rx_kbps`` (NVML KB/s),
    ``nvlink_fields`` (field values 138/139, cumulative KiB), ``gpm`` (metric entries).
    """
    mem = raw.get("memory")
    util = raw.get("utilization")
    rec: dict[str, Any] = {
        "gpu_index": raw.get("index"),
        "gpu_name": raw.get("name"),
        "gpu_uuid": raw.get("uuid"),
        "ts_ns": raw.get("ts_ns"),
        "memory_total_bytes": None, "memory_used_bytes": None,
        "memory_free_bytes": None, "memory_reserved_bytes": None,
    }
    if mem is not None:
        rec["memory_total_bytes"] = int(mem.total)
        rec["memory_used_bytes"] = int(mem.used)
        rec["memory_free_bytes"] = int(mem.free)
        # v1 struct has no ``reserved``; never report 0 for "unknown".
        reserved = getattr(mem, "reserved", None)
        rec["memory_reserved_bytes"] = None if reserved is None else int(reserved)
    procs = raw.get("processes")
    rec["processes"] = None if procs is None else [
        {"pid": int(p.pid),
         "gpu_memory_used_bytes": None if getattr(p, "usedGpuMemory", None) is None else int(p.usedGpuMemory)}
        for p in procs
    ]
    # Busy-time fractions (see module docstring): not evidence of headroom.
    rec["gpu_busy_time_pct"] = None if util is None else float(util.gpu)
    rec["memory_busy_time_pct"] = None if util is None else float(util.memory)
    for k in ("sm_clock_mhz", "mem_clock_mhz", "sm_clock_max_mhz", "mem_clock_max_mhz"):
        rec[k] = _num(raw.get(k))
    mask = raw.get("clock_event_reasons")
    rec["clock_event_reasons_mask"] = mask
    rec["clock_event_reasons"] = decode_clock_event_reasons(mask)
    # "Slowed" = any reason other than idle / app clocks / display: these cost throughput.
    rec["clock_slowdown"] = None if mask is None else bool(mask & ~(0x1 | 0x2 | 0x100))
    pw = raw.get("power_mw")
    rec["power_w"] = None if pw is None else pw / 1000.0
    lim = raw.get("power_limit_mw")
    rec["power_limit_w"] = None if lim is None else lim / 1000.0
    en = raw.get("energy_mj")
    rec["energy_total_j"] = None if en is None else en / 1000.0
    rec["temperature_c"] = _num(raw.get("temperature_c"))
    # NVML reports PCIe throughput in "KB/s" over a 20 ms driver window; nvml.h does not
    # define KB, we take 1024 bytes (an upper reading of at most 2.4% against 1000).
    tx, rx = raw.get("pcie_tx_kbps"), raw.get("pcie_rx_kbps")
    rec["pcie_tx_bytes_per_s"] = None if tx is None else tx * 1024.0
    rec["pcie_rx_bytes_per_s"] = None if rx is None else rx * 1024.0
    nv = raw.get("nvlink_fields")
    rec["nvlink_tx_total_bytes"] = rec["nvlink_rx_total_bytes"] = None
    if nv is not None:
        for fv in nv:
            v = decode_field_value(fv)
            if v is None:
                continue
            if int(fv.fieldId) == FI_NVLINK_THROUGHPUT_DATA_TX:
                rec["nvlink_tx_total_bytes"] = int(v) * 1024
            elif int(fv.fieldId) == FI_NVLINK_THROUGHPUT_DATA_RX:
                rec["nvlink_rx_total_bytes"] = int(v) * 1024
    gpm = raw.get("gpm")
    rec["gpm_interval_ns"] = raw.get("gpm_interval_ns")
    rec.update({k: None for k in GPM_METRICS.values()})
    if gpm is not None:
        rec.update(decode_gpm(gpm))
    rec.update(decode_health(raw))
    rec["source"] = "nvml" + ("+gpm" if gpm is not None else "")
    return rec


def nvml_error_availability(exc: BaseException) -> Availability:
    """Reason and hint for an NVML initialisation failure (pure; used by ``check``)."""
    reason = str(exc) or type(exc).__name__
    value = getattr(exc, "value", None)
    if value == 12 or "Library Not Found" in reason:
        hint = "no NVIDIA driver here (libnvidia-ml.so.1 not found); device metrics are off, other probes run on"
    elif value == 9 or "Driver Not Loaded" in reason:
        hint = "the nvidia kernel module is not loaded (try `nvidia-smi`); device metrics are off"
    elif value == 4 or "Insufficient Permissions" in reason:
        hint = "run the agent with access to /dev/nvidia* (root or the video group)"
    else:
        hint = "check `nvidia-smi`; device metrics are off, other probes run on"
    return Availability(False, f"NVML: {reason}", hint)


# --------------------------------------------------------------------------- NVML glue

def _load_pynvml():
    import pynvml  # lazy: the aggregator and CPU-only hosts import this module freely
    return pynvml


def read_device(nv: Any, handle: Any, index: int, gpm_state: dict | None = None) -> dict[str, Any]:
    """Read one device with read-only NVML calls; unsupported fields come back None.

    ``gpm_state`` holds the previous GPM sample for this device between calls; when given
    and the device supports GPM, the GPM metrics over the interval since the previous call
    are included.
    """
    def get(fn, *a):
        try:
            return fn(*a)
        except nv.NVMLError:
            return None

    raw: dict[str, Any] = {"index": index, "ts_ns": time.time_ns()}
    raw["name"] = get(nv.nvmlDeviceGetName, handle)
    raw["uuid"] = get(nv.nvmlDeviceGetUUID, handle)
    raw["memory"] = get(nv.nvmlDeviceGetMemoryInfo, handle, nv.nvmlMemory_v2) or get(nv.nvmlDeviceGetMemoryInfo, handle)
    raw["processes"] = get(nv.nvmlDeviceGetComputeRunningProcesses, handle)
    raw["utilization"] = get(nv.nvmlDeviceGetUtilizationRates, handle)
    raw["sm_clock_mhz"] = get(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM)
    raw["mem_clock_mhz"] = get(nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM)
    raw["sm_clock_max_mhz"] = get(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM)
    raw["mem_clock_max_mhz"] = get(nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_MEM)
    raw["clock_event_reasons"] = get(nv.nvmlDeviceGetCurrentClocksEventReasons, handle)
    raw["power_mw"] = get(nv.nvmlDeviceGetPowerUsage, handle)
    raw["power_limit_mw"] = get(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    raw["energy_mj"] = get(nv.nvmlDeviceGetTotalEnergyConsumption, handle)
    raw["temperature_c"] = get(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
    raw["pcie_tx_kbps"] = get(nv.nvmlDeviceGetPcieThroughput, handle, nv.NVML_PCIE_UTIL_TX_BYTES)
    raw["pcie_rx_kbps"] = get(nv.nvmlDeviceGetPcieThroughput, handle, nv.NVML_PCIE_UTIL_RX_BYTES)
    raw["nvlink_fields"] = get(nv.nvmlDeviceGetFieldValues, handle,
                               [(FI_NVLINK_THROUGHPUT_DATA_TX, _ALL_LINKS), (FI_NVLINK_THROUGHPUT_DATA_RX, _ALL_LINKS)])
    raw["ecc_counts"] = {k: get(nv.nvmlDeviceGetTotalEccErrors, handle, *k) for k in ECC_COUNTERS}
    raw["retired_pages"] = {c: get(nv.nvmlDeviceGetRetiredPages, handle, c) for c in RETIREMENT_CAUSES}
    raw["retired_pages_pending"] = get(nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    raw["remapped_rows"] = get(nv.nvmlDeviceGetRemappedRows, handle)
    raw["gpm"] = None
    if gpm_state is not None and gpm_state.get("supported"):
        raw["gpm"], raw["gpm_interval_ns"] = _gpm_step(nv, handle, gpm_state)
    return raw


def _gpm_step(nv: Any, handle: Any, state: dict) -> tuple[list | None, int | None]:
    """Take a GPM sample; return metrics between it and the previous one (None the first time)."""
    try:
        sample = nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmSampleGet(handle, sample)
    except nv.NVMLError:
        state["supported"] = False
        return None, None
    now = time.monotonic_ns()
    prev, prev_t = state.get("sample"), state.get("t_ns")
    state["sample"], state["t_ns"] = sample, now
    if prev is None:
        return None, None
    try:
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        ids = sorted(GPM_METRICS)
        mg.numMetrics = len(ids)
        mg.sample1, mg.sample2 = prev, sample
        for i, mid in enumerate(ids):
            mg.metrics[i].metricId = mid
        nv.nvmlGpmMetricsGet(mg)
        return [mg.metrics[i] for i in range(len(ids))], now - prev_t
    except nv.NVMLError:
        return None, None
    finally:
        try:
            nv.nvmlGpmSampleFree(prev)
        except nv.NVMLError:
            pass


def xid_event_set(nv: Any, handles: list) -> Any:
    """An NVML event set with every device that supports Xid events registered, or None
    when none does (read-only: registering for events changes no device state)."""
    try:
        evset = nv.nvmlEventSetCreate()
    except nv.NVMLError:
        return None
    registered = 0
    for h in handles:
        try:
            nv.nvmlDeviceRegisterEvents(h, EVENT_TYPE_XID_CRITICAL_ERROR, evset)
            registered += 1
        except nv.NVMLError:     # NOT_SUPPORTED on this device or platform
            continue
    if registered:
        return evset
    nv.nvmlEventSetFree(evset)
    return None


def drain_xid_events(nv: Any, evset: Any, max_events: int = 64) -> list[tuple[int, int, int]]:
    """The events waiting in ``evset`` (no wait), as (device index, eventType, eventData)."""
    out: list[tuple[int, int, int]] = []
    for _ in range(max_events):
        try:
            data = nv.nvmlEventSetWait_v2(evset, 0)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) != NVML_ERROR_TIMEOUT:
                raise
            break
        try:
            index = nv.nvmlDeviceGetIndex(data.device)
        except nv.NVMLError:
            index = -1
        out.append((index, int(data.eventType), int(data.eventData)))
    return out


class NvmlProbe(Probe):
    """Samples every GPU on a background thread every ``interval_s`` (default 1 s, >= 0.1 s).

    ``poll()`` never calls NVML: it drains the records the sampler thread queued (bounded;
    overflow is dropped and counted) and returns ``{"devices": [record, ...]}`` or None.
    """

    name = "nvml"
    optional = True

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, max_queued: int = 1024, gpm: bool = True):
        super().__init__()
        if not interval_s >= MIN_INTERVAL_S:
            raise ValueError(f"NVML interval {interval_s} s is below the minimum {MIN_INTERVAL_S} s")
        self.interval_s = float(interval_s)
        self.gpm = gpm
        self._queue: collections.deque = collections.deque()
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nv = None
        self._handles: list = []
        self._gpm_state: list[dict] = []
        self._xid_set = None

    def check(self) -> Availability:
        try:
            nv = _load_pynvml()
        except ImportError as exc:
            return Availability(False, f"pynvml not importable: {exc}", "install nvidia-ml-py (bash scripts/setup.sh)")
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            return nvml_error_availability(exc)
        try:
            n = nv.nvmlDeviceGetCount()
        finally:
            nv.nvmlShutdown()
        if n == 0:
            return Availability(False, "NVML: no GPU found", "check `nvidia-smi -L`")
        return Availability(True, f"NVML: {n} GPU(s)")

    def start(self) -> None:
        nv = _load_pynvml()
        nv.nvmlInit()
        self._nv = nv
        self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        self._gpm_state = []
        for h in self._handles:
            supported = False
            if self.gpm:
                try:
                    supported = bool(nv.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
                except nv.NVMLError:
                    supported = False
            self._gpm_state.append({"supported": supported})
        self._xid_set = xid_event_set(nv, self._handles)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ridgeline-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.monotonic()))

    def sample_once(self) -> None:
        """Read every device once and queue the records (the sampler thread calls this)."""
        xids: dict[int, list[int]] | None = None
        if self._xid_set is not None:
            try:
                xids = decode_xid_events(drain_xid_events(self._nv, self._xid_set))
            except self._nv.NVMLError:
                self.errors += 1
        for i, h in enumerate(self._handles):
            try:
                raw = read_device(self._nv, h, i, self._gpm_state[i])
                # None: Xid events unsupported here (never "no errors" for "unknown").
                raw["xids"] = None if xids is None else xids.get(i, [])
                rec = device_record(raw)
            except Exception as exc:  # noqa: BLE001  (a driver hiccup must not kill the sampler; counted, logged)
                self.errors += 1
                if self.errors == 1:
                    log.warning("nvml: device %d not read: %s: %s (counted in errors; said once)", i,
                                type(exc).__name__, exc)
                continue
            with self._lock:
                if len(self._queue) >= self._max_queued:
                    self._queue.popleft()
                    self.drops += 1
                self._queue.append(rec)
            self.records += 1

    def poll(self) -> dict | None:
        with self._lock:
            if not self._queue:
                return None
            recs = list(self._queue)
            self._queue.clear()
        return {"devices": recs}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._nv is not None:
            for st in self._gpm_state:
                if st.get("sample") is not None:
                    try:
                        self._nv.nvmlGpmSampleFree(st["sample"])
                    except self._nv.NVMLError:
                        self.errors += 1
            if self._xid_set is not None:
                try:
                    self._nv.nvmlEventSetFree(self._xid_set)
                except self._nv.NVMLError:
                    pass
                self._xid_set = None
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                self.errors += 1
            self._nv = None

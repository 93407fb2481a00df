"""Thin CUPTI PM-sampling sampler (cupti-python ``pm_sampling``): device-wide hardware counters.

Runs in the agent, not in the served process: PM sampling is per device. It returns
plain columns (sample start/end on the CUPTI clock, one float array per metric) that
``aggregator.counters`` attributes to phases. Everything that can go wrong without a
GPU, a driver, the nvperf libraries or profiling permission becomes one reason line
and a hint (:func:`unavailable_reason`), never an exception out of :meth:`check`.

Cautions carried from CUPTI/PyTorch experience: PM sampling locks GPU clocks while
active (absolute kernel times can shift), needs all metrics in one pass, and the
profiler may be deinitialised only once per process (``stop`` is idempotent).
"""
from __future__ import annotations

import logging

import numpy as np

from ridgeline.probes.probe import Availability

log = logging.getLogger("ridgeline.cupti.pm")

#: What Ridgeline wants (DRAM bytes, tensor-pipe work), most specific first. Which of
#: these a chip exposes for PM sampling is checked on the device (``supported``).
DEFAULT_METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "sm__pipe_tensor_op_hmma_cycles_active.sum",
    "sm__inst_executed_pipe_tensor_op_hmma.sum",
    "gr__cycles_elapsed.max",
)


def unavailable_reason(exc: BaseException) -> tuple[str, str]:
    """``(reason, hint)`` for an exception raised by cupti-python while setting up PM sampling."""
    name = type(exc).__name__
    msg = str(exc).strip() or name
    if isinstance(exc, ImportError):
        return f"cupti-python not importable: {msg}", "install the pinned cupti-python (scripts/setup.sh)"
    if name == "NotSupportedError":
        return f"no CUDA driver: {msg}", "PM sampling needs an NVIDIA GPU with its driver loaded"
    status = getattr(exc, "status", None)
    if isinstance(exc, PermissionError) or status == 35:
        return ("insufficient privileges for GPU performance counters",
                "run the agent as root, or load nvidia with NVreg_RestrictProfilingToAdminUsers=0")
    if status is not None:
        return f"CUPTI error: {msg}", "check the driver supports this CUPTI version (CUPTI_ERROR_NOT_INITIALIZED = too old)"
    if isinstance(exc, ValueError):
        return f"PM sampling configuration rejected: {msg}", "choose metrics that fit one pass on this GPU"
    if "nvperf" in msg.lower():
        return f"nvperf libraries not found: {msg}", "put the nvidia/cu13/lib folder of the wheel on LD_LIBRARY_PATH"
    return f"PM sampling unavailable: {name}: {msg}", ""


class PmSampler:
    """Start/poll/stop PM sampling on one device; :meth:`poll` returns plain columns."""

    name = "cupti_pm_sampling"

    def __init__(self, device_index: int = 0, metrics=DEFAULT_METRICS, interval_ns: int = 10_000_000,
                 hardware_buffer_bytes: int = 64 << 20, max_samples: int = 4096):
        self.device_index = device_index
        self.metrics = list(metrics)
        self.interval_ns = interval_ns
        self.hardware_buffer_bytes = hardware_buffer_bytes
        self.max_samples = max_samples
        self._collector = None
        self._enabled = False
        self.samples = 0
        self.errors = 0

    def check(self) -> Availability:
        try:
            from cupti import pm_sampling
            c = pm_sampling.Collector(self.device_index)
            c.enable()
            c.disable()
        except Exception as e:  # noqa: BLE001  (check() never raises: cupti-python's errors of every kind become the reason)
            reason, hint = unavailable_reason(e)
            return Availability(False, reason, hint)
        return Availability(True, f"PM sampling on device {self.device_index}", "")

    def start(self) -> None:
        from cupti import pm_sampling
        c = pm_sampling.Collector(self.device_index)
        c.enable()
        self._enabled = True
        self._collector = c
        try:
            c.configure(metrics=self.metrics, hardware_buffer_size=self.hardware_buffer_bytes,
                        sampling_interval=self.interval_ns,
                        hw_buffer_append_mode=pm_sampling.HardwareBufferAppendMode.KEEP_LATEST)
            c.start()
        except Exception:
            self.stop()
            raise

    def poll(self) -> dict:
        """Samples completed since the last poll: ``{"start_ns", "end_ns", "values": {metric: float[]}}``."""
        if self._collector is None:
            return {}
        try:
            data = self._collector.decode(self.max_samples)
            samples = list(data)
        except Exception as exc:  # noqa: BLE001  (cupti-python's decode errors: counted, the first of each kind logged)
            self.errors += 1
            if self.errors == 1:
                log.warning("PM sampling: decode failed: %s: %s (counted in errors)", type(exc).__name__, exc)
            return {}
        if not samples:
            return {}
        # the first sample's start can be 0 or stale: drop samples that do not move forward
        starts = np.array([s.start_timestamp for s in samples], np.int64)
        ends = np.array([s.end_timestamp for s in samples], np.int64)
        vals = np.array([s.metric_values for s in samples], np.float64).reshape(len(samples), -1)
        ok = (starts > 0) & (ends > starts)
        self.samples += int(ok.sum())
        return {"start_ns": starts[ok], "end_ns": ends[ok], "device": self.device_index,
                "values": {m: vals[ok, i] for i, m in enumerate(data.metrics)}}

    def stop(self) -> None:
        c, self._collector = self._collector, None
        if c is None or not self._enabled:
            return
        self._enabled = False   # disable() deinitialises the profiler: exactly once
        for step in (c.stop, c.disable):
            try:
                step()
            except Exception as exc:  # noqa: BLE001  (stop() is idempotent and never raises; counted, logged)
                self.errors += 1
                log.warning("PM sampling: %s failed: %s: %s", step.__name__, type(exc).__name__, exc)

    def counters(self) -> dict:
        return {"records": self.samples, "drops": 0, "errors": self.errors}


def metric_list(device_index: int = 0) -> dict:
    """The chip's PM-sampling metric names (for the GPU check script): base metrics and
    single-pass sets; raises what cupti-python raises."""
    from cupti import pm_sampling, profiler_host
    # cupti-python resolves the chip name while enabling a collector (it initialises the
    # profiler first); reuse that instead of repeating its parameter plumbing
    c = pm_sampling.Collector(device_index)
    c.enable()
    try:
        chip = getattr(c, "_chip_name", None)
    finally:
        c.disable()
    if isinstance(chip, bytes):
        chip = chip.decode()
    if not chip:
        raise RuntimeError("cupti-python did not report the chip name")
    host = profiler_host.ProfilerHost(chip, profiler_host.ProfilerType.PM_SAMPLING)
    host.initialize()
    out = {"chip": chip, "base_metrics": {}}
    for t in profiler_host.MetricType:
        try:
            out["base_metrics"][t.name] = list(host.get_base_metrics(t))
        except Exception as e:  # noqa: BLE001  (a diagnostic listing: each failure is said in its entry)
            out["base_metrics"][t.name] = f"error: {e}"
    try:
        sets = profiler_host.get_single_pass_sets(chip)
        out["single_pass_sets"] = {s: list(profiler_host.get_metrics_in_single_pass_set(chip, s)) for s in sets}
    except Exception as e:  # noqa: BLE001  (a diagnostic listing: the failure is said in its entry)
        out["single_pass_sets"] = f"error: {e}"
    return out

"""PM sampler without a GPU: the reason path, with cupti-python's real exceptions."""
from __future__ import annotations

import pytest
from support import hardware

from ridgeline.probes.cupti.pm_sampler import PmSampler, unavailable_reason


@pytest.mark.skipif(hardware.gpu_missing() is None, reason="a GPU is present: the no-GPU reason path does not apply")
def test_check_without_driver_gives_a_reason_and_hint():
    av = PmSampler(0).check()
    assert not av.ok
    assert av.reason.startswith("no CUDA driver") and "libcuda" in av.reason
    assert "NVIDIA GPU" in av.hint


def test_reasons_for_each_failure():
    from cupti import cupti
    from cupti._internal.utils import NotSupportedError
    assert unavailable_reason(NotSupportedError("CUDA driver is not found"))[0].startswith("no CUDA driver")
    r, h = unavailable_reason(cupti.cuptiError(35))
    assert "privileges" in r and "NVreg_RestrictProfilingToAdminUsers" in h
    r, _ = unavailable_reason(cupti.cuptiError(15))
    assert r == "CUPTI error: ERROR_NOT_INITIALIZED (15)"
    assert "one pass" in unavailable_reason(ValueError("needs 2 passes"))[1]
    assert "LD_LIBRARY_PATH" in unavailable_reason(RuntimeError("libnvperf_host.so not found"))[1]
    assert unavailable_reason(ImportError("no cupti"))[0].startswith("cupti-python not importable")


def test_stop_is_idempotent_and_poll_is_empty_before_start():
    s = PmSampler(0)
    assert s.poll() == {}
    s.stop()
    s.stop()
    assert s.counters() == {"records": 0, "drops": 0, "errors": 0}


@pytest.mark.gpu
def test_pm_sampling_on_a_gpu_returns_samples():
    import time
    s = PmSampler(0, metrics=["gr__cycles_elapsed.max"])
    s.start()
    try:
        time.sleep(0.2)
        out = s.poll()
    finally:
        s.stop()
    assert len(out["start_ns"]) > 0 and (out["end_ns"] > out["start_ns"]).all()

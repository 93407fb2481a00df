"""agent.registry: availability with reasons, optional probes skipped, start order."""
import logging

import pytest

from ridgeline.agent import config, registry
from ridgeline.agent.probe_names import PROBE_NAMES
from ridgeline.probes.errors import InputError
from ridgeline.probes.probe import Availability, Probe


def test_every_step_reports_availability_without_raising():
    cfg = config.defaults()
    for name in registry.STEPS:
        probe, av = registry.availability(name, cfg)
        assert isinstance(av, Availability)
        if not av.ok:
            assert av.reason, name
        if probe is not None:
            probe.stop()


def test_the_steps_are_the_probe_names_the_config_accepts():
    """agent.config checks probes.enabled against PROBE_NAMES, not STEPS (which would close
    an import circle): a step added or renamed here without it would be refused at load,
    or a name accepted at load would have no step."""
    assert tuple(registry.STEPS) == PROBE_NAMES


def test_unknown_probe_names_the_known_ones():
    _, av = registry.availability("gpu-magic", config.defaults())
    assert not av.ok and "unknown probe 'gpu-magic'" in av.reason and "sched" in av.hint


def test_unavailable_optional_probe_is_logged_once_and_others_start(caplog, monkeypatch, tmp_path):
    class Fine(Probe):
        name = "fine"
        started = False

        def start(self):
            Fine.started = True

    class Broken(Probe):
        name = "broken"

        def start(self):
            raise OSError("device busy")

    steps = dict(registry.STEPS)
    steps["a"] = registry.Step("a", "events", lambda cfg: (_ for _ in ()).throw(registry.Unavailable("no lib", "install it")), "")
    steps["b"] = registry.Step("b", "events", lambda cfg: Broken(), "")
    steps["c"] = registry.Step("c", "events", lambda cfg: Fine(), "")
    monkeypatch.setattr(registry, "STEPS", steps)
    with caplog.at_level(logging.WARNING, logger="t"):
        run = registry.start_all(config.defaults(), logging.getLogger("t"), ["a", "b", "c"])
    assert [r.step.name for r in run] == ["c"] and Fine.started
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["probe a unavailable: no lib (hint: install it)",
                    "probe b failed to start: OSError: device busy"]


def test_required_probe_failure_is_an_input_error(monkeypatch):
    class Needed(Probe):
        name = "needed"
        optional = False

        def check(self):
            return Availability(False, "not here", "get one")

    monkeypatch.setattr(registry, "STEPS", {"n": registry.Step("n", "events", lambda cfg: Needed(), "")})
    with pytest.raises(InputError, match="probe n unavailable: not here"):
        registry.start_all(config.defaults(), logging.getLogger("t"), ["n"])


def test_each_step_builds_the_class_named_for_it_from_its_table():
    """Registration is explicit: each factory names its probe's class and hands it the
    configuration's values by name (no class-name guessing, no signature filtering)."""
    from ridgeline.agent.simulator.probe import SimulatorProbe
    from ridgeline.probes.cuda_uprobes import CudaUprobeProbe
    from ridgeline.probes.cupti import CuptiProbe
    from ridgeline.probes.engine import EngineProbe
    from ridgeline.probes.nvml import NvmlProbe
    from ridgeline.probes.otlp_receiver import OtlpProbe
    from ridgeline.probes.probe import ProbeLike
    from ridgeline.probes.replay import ReplayProbe
    from ridgeline.probes.sched import SchedProbe
    from ridgeline.probes.sglang_request_metrics import SglangRequestMetricsProbe
    classes = {"sched": SchedProbe, "cuda_uprobes": CudaUprobeProbe, "cupti": CuptiProbe, "nvml": NvmlProbe,
               "engine": EngineProbe, "otlp": OtlpProbe, "sglang_requests": SglangRequestMetricsProbe, "simulator": SimulatorProbe,
               "replay": ReplayProbe}
    assert set(classes) == set(registry.STEPS)
    cfg = config.overlay(config.defaults(), {"probes": {"cupti": {"socket": "/run/x/cupti.sock"},
                                                        "engine": {"timeout_s": 1.25}}})
    for name, cls in classes.items():
        probe = registry.STEPS[name].factory(cfg)
        assert type(probe) is cls and isinstance(probe, ProbeLike), name
        probe.stop()
    assert registry.STEPS["cupti"].factory(cfg).socket_path == "/run/x/cupti.sock"
    assert registry.STEPS["engine"].factory(cfg).timeout_s == 1.25


def test_check_command_lists_every_probe(capsys):
    import argparse

    from ridgeline.agent.commands import check
    from ridgeline.probes.errors import RuntimeFailure
    # A named probe that cannot run is a runtime failure (exit 1), after the full listing.
    with pytest.raises(RuntimeFailure, match="probe replay cannot run here"):
        check.run(argparse.Namespace(config=None, probe=["replay", "simulator"], json=False, agent_timeout=0,
                                            endpoint=None, server_key=None, client_key=None))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith("agent") and "not asked" in out[2]
    assert out[0].startswith("replay") and "unavailable" in out[0] and "hint: set probes.replay.path" in out[0]
    assert out[1].startswith("simulator")

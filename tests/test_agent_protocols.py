"""The agent's loop asks whether a running probe has a readiness descriptor (``Readiness``)
and whether it is the CUPTI probe (``CuptiControl``) once per probe object
(``Agent._protocols``), not at every wake-up and window: a runtime Protocol check walks
the protocol's members through typing. The answers must be isinstance's, for the probe
object asked about (an id reused by a new probe after the old one went is asked again)."""
from __future__ import annotations

from ridgeline.agent import config
from ridgeline.agent import daemon as daemon_mod
from ridgeline.agent.daemon import Agent
from ridgeline.agent.registry import STEPS, Running
from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.probe import Availability, CuptiControl, Probe, Readiness, wake_pipe


class Timed(Probe):
    name = "timed"

    def poll(self):
        return None


class WithFd(Probe):
    name = "fd"

    def __init__(self):
        super().__init__()
        self.pipe = wake_pipe()

    def ready_fd(self):
        return self.pipe[0]

    def poll(self):
        return None


def _agent(tmp_path, probes):
    cfg = config.overlay(config.defaults(), {
        "agent": {"window_s": 1.0}, "publisher": {"endpoint": f"ipc://{tmp_path}/agent.sock"},
        "prometheus": {"enabled": False}, "probes": {"enabled": []}})
    return Agent(cfg, probes=[Running(STEPS["cupti"], p, Availability(True)) for p in probes])


def test_answers_are_isinstances(tmp_path):
    probes = [Timed(), WithFd(), CuptiProbe(socket_path=str(tmp_path / "c.sock"))]
    a = _agent(tmp_path, probes)
    for p in probes:
        assert a._protocols(p) == (isinstance(p, Readiness), isinstance(p, CuptiControl))
    assert a._protocols(probes[0]) == (False, False)
    assert a._protocols(probes[1]) == (True, False)
    assert a._protocols(probes[2]) == (True, True)


def test_checked_once_per_probe_object(tmp_path, monkeypatch):
    p, q = WithFd(), Timed()
    a = _agent(tmp_path, [p, q])
    checks = []

    def counting(obj, cls):
        checks.append((obj, cls))
        return isinstance(obj, cls)
    monkeypatch.setattr(daemon_mod, "isinstance", counting, raising=False)
    for _ in range(5):
        a._protocols(p)
        a._protocols(q)
        a._wait_set()
    assert len([c for c in checks if c[1] in (Readiness, CuptiControl)]) == 4


def test_a_new_probe_under_a_remembered_id_is_asked_again(tmp_path):
    q = Timed()
    a = _agent(tmp_path, [q])
    # what a probe that had q's id (gone since) left behind: q must not get its answers
    a._probe_protocols[id(q)] = (WithFd(), True, True)
    assert a._protocols(q) == (False, False)

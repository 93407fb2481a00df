"""agent.health: the agent's accounting (issue 14.8): dropped records and dropped batches
are separate figures, never one summed `drops`; the CUPTI socket's failed accepts count
as errors."""
import types

from ridgeline.agent.health import HealthMeter


def test_dropped_records_and_batches_are_reported_apart():
    h = HealthMeter(clock=iter([0, 10**9]).__next__, cpu=lambda: 0)
    out = h.sample({"cupti": {"records": 100, "drops": 7, "dropped_batches": 2, "errors": 1},
                    "engine": {"records": 3, "drops": 0, "dropped_batches": 4, "errors": 0}}, 103)
    assert out["dropped_records"] == 7 and out["dropped_batches"] == 6
    assert "drops" not in out
    assert out["errors"] == 1


def test_cupti_accept_errors_count_as_errors_and_queue_drops_as_batches():
    from ridgeline.probes.cupti.probe import CuptiProbe
    p = CuptiProbe(socket_path="/run/ridgeline-test-none/c.sock")
    p.server = types.SimpleNamespace(stats={"accept_errors": 3, "protocol_errors": 1,
                                            "dropped_batches_queue_full": 5}, connections=0)
    c = p.counters()
    assert c["server_accept_errors"] == 3
    assert c["errors"] == 4                   # accept errors are in errors
    assert c["dropped_batches"] == 5 and c["drops"] == 0   # batches are not records
    p.server = None

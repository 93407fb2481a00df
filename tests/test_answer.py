"""aggregator.answer: a verdict record read as a VerdictRecord, worded the same either way."""
import msgspec
from support.phase_literals import decode_literal_trace

from ridgeline.aggregator.analysis import analyze_trace
from ridgeline.aggregator.answer import VerdictRecord, answer_lines, verdict_records


def test_a_window_record_and_its_struct_give_the_same_lines():
    t, pm = decode_literal_trace()
    (rec,) = verdict_records(analyze_trace(t, phase_map=pm).answer)
    lines = answer_lines(rec)
    assert lines == answer_lines(msgspec.convert(rec, VerdictRecord))
    # the record's own words: its verdict first, each face it rules out or cannot judge after
    assert lines[0].startswith(f"gpu{rec['device']}: {rec['verdict']}")
    assert len(lines) == 1 + max(0, len(rec["reasons"]) - 1) + sum(
        f["state"] not in ("binds", "binds (below the thresholds)") for f in rec["faces"]) + len(
        rec["caveats"]) + len(rec["limits"])


def test_an_engine_only_record_is_the_engines():
    assert answer_lines({"verdict": "queue-bound", "device": None, "reasons": ["waiting 12"]}) == [
        "engine: queue-bound: waiting 12"]


def test_a_malformed_record_is_said_in_one_line_not_raised():
    (line,) = answer_lines({"verdict": "x", "reasons": "not a list"})
    assert line.startswith("verdict record not readable: ") and "reasons" in line

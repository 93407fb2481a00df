"""``ridgeline tail``'s one-line summaries, read from the golden wire messages as typed records."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ridgeline.agent.commands.tail import summary
from ridgeline.aggregator import wire

DATA = Path(__file__).parent / "data"


def _envelope(name: str):
    env = wire.decode_envelope((DATA / name).read_bytes())
    return dataclasses.replace(env, payload=wire.decode_window(env.payload)) if env.topic == "window" else env


def test_window_and_health_summaries_of_the_golden_messages():
    assert summary(_envelope("wire_envelope_window_v1.bin")) == \
        "1 gpu/process, 51234 kernels, verdict -, agent cpu=0.8% rss=79MiB"
    assert summary(_envelope("wire_envelope_health_v1.bin")) == \
        "cpu=1.5% rss=86MiB records/s=0 dropped records=0 batches=0 stream=0"
    # a window without an agent record or GPUs still has its line
    assert summary(dataclasses.replace(_envelope("wire_envelope_window_v1.bin"), payload={})) == \
        "0 gpu/process, 0 kernels, verdict -, agent cpu=0.0% rss=0MiB"


def test_a_window_of_the_wrong_shape_is_one_line_naming_the_field():
    env = dataclasses.replace(_envelope("wire_envelope_window_v1.bin"), payload={"gpus": [{"kernels": "many"}]})
    line = summary(env)
    assert line.startswith("window not readable as a window record: ") and "$.gpus[0].kernels" in line
    assert "\n" not in line

"""Served requests as the operator reads them: the stories on the agent's ``requests`` topic.

Contract:

* :func:`stories_of(payload)` turns one ``requests`` message (``{"end_ns", "stories":
  [...]}``, as :mod:`agent.daemon` publishes it) into typed
  :class:`aggregator.request_join.RequestStory` records; a story that does not convert is
  counted in the returned number, never raised.
* :func:`slowest(stories, limit)`: the slowest first (end-to-end time), each request once.
* :func:`table(stories)`: the ``ridgeline requests`` table (text, one line per request):
  its segments in seconds (with its pauses and its re-prefills after them) and its top
  culprit; :func:`as_json` the same as plain data.
* :func:`load_json(path)` reads the output of ``ridgeline requests --json`` back (for
  ``ridgeline why --input``): one clear :class:`probes.errors.InputError` on bad input,
  bounded in size.
"""
from __future__ import annotations

import json

import msgspec

from ridgeline.aggregator import request_join as rj
from ridgeline.probes.errors import InputError
from ridgeline.probes.untrusted_text import for_log

#: Largest ``--input`` file read (a ``requests --json`` output of a few thousand requests).
MAX_INPUT_BYTES = 64 * 2**20


def stories_of(payload) -> tuple[list[rj.RequestStory], int]:
    if not isinstance(payload, dict) or not isinstance(payload.get("stories"), list):
        return [], 1
    out, bad = [], 0
    for s in payload["stories"]:
        try:
            out.append(msgspec.convert(s, rj.RequestStory))
        except msgspec.ValidationError:
            bad += 1
    return out, bad


def printable(s: rj.RequestStory) -> rj.RequestStory:
    """The story with its request ids (a peer's text: the engine's span) made one printable
    line each, so a request id can never drive the terminal of whoever reads it."""
    culprits = [msgspec.structs.replace(c, request_id=for_log(c.request_id)) for c in s.culprits]
    return msgspec.structs.replace(s, request_id=for_log(s.request_id), engine=for_log(s.engine),
                                   culprits=culprits)


def slowest(stories: list[rj.RequestStory], limit: int) -> list[rj.RequestStory]:
    by_id = {s.request_id: s for s in stories}
    return sorted(by_id.values(), key=lambda s: -s.e2e_ns)[:limit]


def _s(ns: int) -> str:
    return f"{ns / 1e9:.2f}" if ns >= 0 else "-"


def table(stories: list[rj.RequestStory]) -> str:
    head = (f"{'request':<24} {'e2e s':>7} {'queue s':>7} {'prefill s':>9} {'decode s':>8} {'paused s':>8} "
            f"{'recomp s':>8} {'dragged s':>9} {'ms/token':>8}  top culprit")
    lines = [head]
    for s in stories:
        c = s.culprits[0] if s.culprits else None
        size = "tokens prefilled" if c and "prefill_chunk" in c.kind else "prompt tokens"
        culprit = (f"{for_log(c.request_id)[:24]} +{c.added_ns / 1e9:.2f} s ({c.kind.replace('_', ' ')}, "
                   f"{c.tokens} {size})") if c else "-"
        est = "~" if s.dragged_source == rj.SOURCE_ESTIMATE else ""
        drag = "?" if s.dragged_source == rj.SOURCE_NONE else est + _s(s.dragged_ns)
        per = f"{s.ns_per_token / 1e6:.1f}" if s.ns_per_token > 0 else "-"
        # paused: preempted (out of every step), left out of prefill and decode
        paused = _s(s.paused_ns) if s.paused_ns > 0 else "-"
        # recomp: its re-prefills after those pauses, left out of decode
        recomp = _s(s.recompute_ns) if s.recompute_steps > 0 else "-"
        lines.append(f"{for_log(s.request_id)[:24]:<24} {_s(s.e2e_ns):>7} {_s(s.queue_ns):>7} "
                     f"{_s(s.prefill_ns):>9} {_s(s.decode_ns):>8} {paused:>8} {recomp:>8} {drag:>9} {per:>8}  "
                     f"{culprit}")
    if len(lines) == 1:
        lines.append("(no request joined yet: is an engine sending its spans to the agent's OTLP receiver?)")
    else:
        lines.append("dragged: decode time added by co-batched prefill chunks and long sequences "
                     "(~ roofline estimate, ? no baseline); paused: preempted, out of prefill and decode; "
                     "recomp: re-prefilling its prompt and generated tokens after a preemption, out of decode")
    return "\n".join(lines)


def as_json(stories: list[rj.RequestStory], windows: int) -> str:
    return json.dumps({"windows": windows, "requests": msgspec.to_builtins(stories)}, indent=1)


def load_json(path: str) -> list[rj.RequestStory]:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise InputError(f"--input {path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_INPUT_BYTES:
        raise InputError(f"--input {path}: larger than {MAX_INPUT_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise InputError(f"--input {path}: not JSON (give the output of `ridgeline requests --json`)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise InputError(f"--input {path}: no \"requests\" list (give the output of `ridgeline requests --json`)")
    try:
        return [msgspec.convert(s, rj.RequestStory) for s in doc["requests"]]
    except msgspec.ValidationError as exc:
        raise InputError(f"--input {path}: a request is malformed: {str(exc)[:160]}") from None

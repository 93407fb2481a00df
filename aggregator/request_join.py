"""Each served request joined with the GPU steps it ran in: "is it slow, or dragged?"

Inputs (all plain, typed):

* ``requests``: :class:`probes.request_spans.RequestSpan` records (the engine's own span:
  arrival, queue time, time to first token, end, token counts);
* ``steps``: a :data:`STEP_DTYPE` array of the GPU steps Ridgeline saw (start, end, phase);
* ``kv``: a :data:`KV_DTYPE` array of the engine's KV-cache usage samples (time, ratio).

A request's life is cut by its own span: queued ``[arrival, arrival + queue)``, prefill
``[arrival + queue, arrival + TTFT)`` (every step inside is one of its prefill chunks:
chunked prefill counts as many chunks as steps), decode ``[arrival + TTFT, end)``. A step
belongs to the requests whose prefill or decode interval holds its midpoint; a member's
context grows linearly over its decode steps (prompt + tokens so far), a prefilling
member's prompt is spread evenly over its chunks.

Dragged time: for each decode step of request R, the *culprits* are the co-batched members
that are prefill chunks, or long sequences (context >= ``long_tokens`` and longer than R's
own). The step time the same batch takes without them comes from a linear step-time model
``c0 + c1 * decode_members + c2 * context_tokens + c3 * prefill_tokens`` fitted by least
squares on the window's measured steps when the window has both kinds (steps with culprits
and steps without) and the fit is determined; else from ``estimate_step_ns`` (the
roofline model of the served model on its GPU) and marked ``"roofline_estimate"``; else
nothing is attributed (``"none"``). R's dragged time in a step is the measured step time
minus that baseline (never below 0), shared among the culprits in proportion to their
marginal cost in the model. Summed over R's decode steps, per culprit.

Preemption (recompute): a request is a member of no step inside a pause (``pauses`` of its
span). Resumed after a pause inside its decode, it first re-prefills its prompt and the
tokens generated so far (its KV was freed): those steps (the PREFILL or MIXED steps from the
resume, bounded as :meth:`_Batch._recompute` says) are its *recompute* (``recompute_ns``,
``recompute_steps``), not its decode: its decode time, steps, ns per token and alone decode
leave them out. In them it is a prefill chunk of ``prompt + generated`` tokens for the
others batched with it (their culprit, of that size).

All figures are ns, token counts, or ratios. Pure: no I/O, numpy only.
"""
from __future__ import annotations

import bisect

import numpy as np

from ridgeline.probes.records import Culprit, Exemplar, Pause, RequestStory, WindowRequests  # noqa: F401 (this module's records)
from ridgeline.probes.request_spans import RequestSpan

from .phases import DECODE, MIXED, PREFILL

STEP_DTYPE = np.dtype([("start_ns", np.int64), ("end_ns", np.int64), ("phase", np.uint8)])
KV_DTYPE = np.dtype([("ts_ns", np.int64), ("usage_ratio", np.float64)])

#: A co-batched sequence at least this long (prompt + generated) counts as a long one.
LONG_SEQUENCE_TOKENS = 2048
#: KV-cache usage at or over this ratio while a request waited: the pool was full.
KV_FULL_RATIO = 0.95
#: Culprits kept per request, and requests kept per window's slowest list.
MAX_CULPRITS = 5
#: Pauses a story carries (its paused_ns counts them all).
MAX_STORY_PAUSES = 16
#: Pauses cut into the batch per join at most: every pause of the requests told, then the
#: other held requests' (the latest ended first) while the budget lasts; past it a held
#: request counts as a member through its pauses (as before pauses were carried). Each
#: pause adds a piece, and the culprit search's cost grows with the pieces: 20,000 held
#: requests of 16 pauses each took 13 s of CPU a window uncut, 2 s without pauses.
MAX_JOIN_PAUSES = 4096
MAX_SLOWEST = 20
#: Requests joined per window at most (the newest are kept; the rest are counted).
MAX_REQUESTS = 20_000
#: Measured steps of each kind (with culprits, without) the fit needs at least.
MIN_FIT_STEPS = 4
#: A request whose decode is more than this share added by others is "being dragged".
DRAGGED_VERDICT_SHARE = 0.2

SOURCE_MEASURED = "measured"
SOURCE_ESTIMATE = "roofline_estimate"
SOURCE_NONE = "none"
SOURCE_NO_CULPRITS = "no_culprits"      # nothing co-batched with it was a culprit: dragged 0


#: Upper bounds (s) of the per-window end-to-end histogram (``/metrics``: its buckets carry
#: exemplars, the request ids of the slowest request in each); the last bucket is +Inf.
E2E_BOUNDS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Request ids in exemplars are cut to this (OpenMetrics: an exemplar's label names and
#: values together hold at most 128 UTF-8 characters; with ``trace_id`` 32 hex).
EXEMPLAR_ID_CHARS = 64


def _intervals(r: RequestSpan) -> tuple[int, int, int, int]:
    arrival, end = r.start_ns, r.end_ns
    sched = arrival + r.queue_ns if r.queue_ns >= 0 else arrival
    if r.ttft_ns >= 0:
        first = arrival + r.ttft_ns
    elif r.prefill_ns >= 0:
        first = sched + r.prefill_ns
    else:
        first = sched
    sched, first = min(sched, end), min(max(first, sched), end)
    return arrival, sched, first, end


def _diff_add(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray, val: np.ndarray) -> None:
    """arr[lo:hi] += val for every (lo, hi, val), by a difference array (arr has n+1 slots)."""
    np.add.at(arr, lo, val)
    np.add.at(arr, hi, -val)


def _pause_overlap_ns(pauses, lo: int, hi: int) -> int:
    """Time of the (disjoint) pauses inside ``[lo, hi)``."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in pauses)


class _Batch:
    """Per-step batch composition, columnar.

    A request is a member of the steps of its prefill and decode intervals except those
    inside a pause (a preemption, until resumed): its life there is cut into *pieces*,
    each a contiguous run of its steps, and every per-member array below is per piece
    (``owner`` maps a piece to its request). Its prompt is spread over all its prefill
    steps, its generated tokens over all its decode steps: its context does not grow
    while it is paused."""

    def __init__(self, reqs: list[RequestSpan], steps: np.ndarray, with_pauses: np.ndarray | None = None):
        n = len(steps)
        self.mid = (steps["start_ns"] + steps["end_ns"]) // 2
        self.dur = (steps["end_ns"] - steps["start_ns"]).astype(np.float64)
        iv = np.array([_intervals(r) for r in reqs], dtype=np.int64).reshape(-1, 4)
        pf_lo = np.searchsorted(self.mid, iv[:, 1], "left")
        pf_hi = np.searchsorted(self.mid, iv[:, 2], "left")
        dc_hi = np.searchsorted(self.mid, iv[:, 3], "left")
        prompt = np.array([max(r.prompt_tokens, 0) for r in reqs], dtype=np.float64)
        gen = np.array([max(r.completion_tokens, 0) for r in reqs], dtype=np.float64)
        # Pieces: [pf_lo, dc_hi) less the steps inside each pause. ``resumed``: the piece
        # starts where a pause inside the decode ended (its re-prefill comes first).
        owner, lo_l, hi_l, resumed_l = [], [], [], []
        for i, r in enumerate(reqs):
            lo, hi = int(pf_lo[i]), int(dc_hi[i])
            resumed = False
            if r.pauses and (with_pauses is None or with_pauses[i]):
                cut = np.searchsorted(self.mid, np.asarray(r.pauses, dtype=np.int64).reshape(-1, 2), "left")
                for (a, b), (pre_ns, _res_ns) in zip(cut.tolist(), r.pauses):
                    in_decode = pre_ns >= iv[i, 2]
                    if b <= a and not (in_decode and lo < a < hi):
                        # A pause between two steps' midpoints cuts nothing; one in the
                        # decode still ends the piece there (its re-prefill follows).
                        continue
                    if min(a, hi) > lo:
                        owner.append(i)
                        lo_l.append(lo)
                        hi_l.append(min(a, hi))
                        resumed_l.append(resumed)
                    lo = max(lo, b)
                    resumed = in_decode
                    if lo >= hi:
                        break
            if hi > lo or not owner or owner[-1] != i:
                owner.append(i)
                lo_l.append(lo)
                hi_l.append(max(lo, hi))
                resumed_l.append(resumed)
        self.owner = np.asarray(owner, dtype=np.int64)
        p_lo, p_hi = np.asarray(lo_l, dtype=np.int64), np.asarray(hi_l, dtype=np.int64)
        o = self.owner
        self.pf_lo = np.minimum(np.maximum(p_lo, pf_lo[o]), p_hi)
        self.pf_hi = np.maximum(np.minimum(p_hi, pf_hi[o]), self.pf_lo)
        self.dc_lo = np.minimum(np.maximum(p_lo, pf_hi[o]), p_hi)
        self.dc_hi = np.maximum(p_hi, self.dc_lo)
        n_req = len(reqs)
        pf_steps = np.bincount(o, weights=self.pf_hi - self.pf_lo, minlength=n_req)
        first_piece = np.searchsorted(o, np.arange(n_req), "left")
        self.chunk = prompt[o] / np.maximum(pf_steps[o], 1)         # tokens per prefill chunk
        #: Per piece: the tokens its prefill steps computed (the prompt, or prompt + the
        #: tokens generated before the pause for a re-prefill), and its re-prefill steps.
        self.pf_tokens = prompt[o].copy()
        self.rc = self._recompute(reqs, steps, o, p_lo, p_hi, np.asarray(resumed_l, dtype=bool), pf_lo,
                                  pf_hi, prompt, gen, pf_steps, first_piece)
        # A re-prefill is a prefill member there: the decode starts after it.
        self.pf_hi = self.pf_hi + self.rc
        self.dc_lo = self.dc_lo + self.rc
        dc_steps_piece = self.dc_hi - self.dc_lo
        dc_steps = np.bincount(o, weights=dc_steps_piece, minlength=n_req)
        self.prompt, self.gen = prompt[o], gen[o]
        self.slope = gen[o] / np.maximum(dc_steps[o], 1)            # context growth per decode step
        # Decode steps the owner ran before each piece (pieces are in step order per owner).
        before = np.cumsum(dc_steps_piece) - dc_steps_piece
        done = before - before[first_piece[o]]
        self.ctx0 = prompt[o] + self.slope * (done - self.dc_lo)   # context at step j: ctx0 + slope * j
        #: Per request: its decode and prefill steps (pauses and re-prefills left out), its
        #: re-prefill steps and their GPU time.
        self.decode_steps = dc_steps.astype(np.int64)
        self.prefill_steps = pf_steps.astype(np.int64)
        self.recompute_steps = np.bincount(o, weights=self.rc, minlength=n_req).astype(np.int64)
        cum = np.concatenate([[0.0], np.cumsum(self.dur)])
        #: Per piece: its re-prefill's GPU time (0: none), and the step it starts at.
        self.rc_ns = cum[p_lo + self.rc] - cum[p_lo]
        self.p_lo = p_lo
        self.step_start_ns, self.step_end_ns = steps["start_ns"], steps["end_ns"]
        self.recompute_ns = np.bincount(o, weights=self.rc_ns, minlength=n_req)
        ndec = np.zeros(n + 1)
        _diff_add(ndec, self.dc_lo, self.dc_hi, np.ones(len(o)))
        a = np.zeros(n + 1)
        b = np.zeros(n + 1)
        _diff_add(a, self.dc_lo, self.dc_hi, self.ctx0)
        _diff_add(b, self.dc_lo, self.dc_hi, self.slope)
        pf = np.zeros(n + 1)
        _diff_add(pf, self.pf_lo, self.pf_hi, self.chunk)
        j = np.arange(n, dtype=np.float64)
        self.n_dec = np.cumsum(ndec)[:n]
        self.ctx = np.cumsum(a)[:n] + np.cumsum(b)[:n] * j
        self.pf = np.cumsum(pf)[:n]
        self.features = np.column_stack([np.ones(n), self.n_dec, self.ctx, self.pf])
        self.intervals = iv
        self._first_piece = np.append(first_piece, len(o))

    def _recompute(self, reqs, steps, o, p_lo, p_hi, resumed, pf_lo, pf_hi, prompt, gen, pf_steps, first_piece):
        """Per piece, the steps at its start in which its owner re-prefills after a pause
        in its decode (0 for every other piece); sets the re-prefill's ``chunk`` and
        ``pf_tokens``.

        A recompute preemption forgets the request's KV (vLLM V1 ``_preempt_request``:
        ``num_computed_tokens = 0``; SGLang ``retract_decode`` -> ``reset_for_retract``);
        rescheduled, it computes its prompt and the tokens it generated so far again as a
        prefill, cut into chunks by the step's token budget. Its re-prefill is the run of
        PREFILL or MIXED steps from its resume, ending at the first DECODE step (it can be
        decoding in no step of a pure prefill, nor re-prefilling in a decode-only one),
        and at most as many steps as its refill needs in chunks as large as its first
        prefill's: ``refill * (chunks - 1) / prompt`` rounded up, at least 1 (a prompt cut
        into ``chunks`` steps had a chunk above ``prompt / chunks``; one prefilled in one
        step is re-prefilled in one). The bound matters under load, where the steps stay
        MIXED after its re-prefill because others prefill. The refill is its prompt + the
        tokens generated before the pause: one with its prefill's last step, one per
        decode step and one per earlier re-prefill (each re-prefill's last step samples
        one, as a prefill's does), at most its completion tokens."""
        rc = np.zeros(len(o), dtype=np.int64)
        resumed = resumed & (p_lo >= pf_hi[o]) & (p_hi > p_lo)
        if not resumed.any():
            return rc
        n = len(steps)
        dec = np.flatnonzero(steps["phase"] == DECODE)
        pos = np.searchsorted(dec, np.arange(n), "left")
        # The first DECODE step at or after each step (n: none).
        next_dec = np.where(pos < len(dec), dec[np.minimum(pos, len(dec) - 1)], n) if len(dec) else np.full(n, n)
        dc_lo = np.minimum(np.maximum(p_lo, pf_hi[o]), p_hi)
        dc_n = np.maximum(p_hi, dc_lo) - dc_lo
        for k in np.flatnonzero(resumed).tolist():
            i, f = int(o[k]), int(first_piece[o[k]])
            made = 1 + int(dc_n[f:k].sum() - rc[f:k].sum()) + int((rc[f:k] > 0).sum())
            if reqs[i].completion_tokens > 0:
                made = min(made, int(gen[i]))
            refill = float(prompt[i]) + made
            chunks = int(pf_steps[i])
            cap = max(1, -(-int(refill) * (chunks - 1) // int(prompt[i]))) if prompt[i] > 0 else 1
            m = min(int(min(next_dec[p_lo[k]], p_hi[k]) - p_lo[k]), cap)
            if m > 0:
                rc[k] = m
                self.pf_tokens[k] = refill
                self.chunk[k] = refill / m
        return rc

    def pauses_with_recompute(self, i: int, pauses) -> list[Pause]:
        """Request i's ``pauses`` ((start_ns, end_ns) pairs) as Pause records, each with
        the re-prefill that followed it: a re-prefill belongs to the last pause that began
        before its first step did. One that began before every pause given (a span whose
        pauses the engine did not all send) is in the request's recompute_ns, in no pause's."""
        out = [[int(a), int(b), None, None] for a, b in pauses]
        starts = [p[0] for p in out]
        for k in self.pieces_of(i):
            m = int(self.rc[k])
            if not m:
                continue
            lo = int(self.p_lo[k])
            j = bisect.bisect_right(starts, int(self.step_start_ns[lo])) - 1
            if j >= 0:
                got = out[j]
                got[2] = (got[2] or 0) + int(round(self.rc_ns[k]))
                got[3] = max(got[3] or 0, int(self.step_end_ns[lo + m - 1]))
        return [Pause(a, b, rc, end) for a, b, rc, end in out]

    def pieces_of(self, i: int) -> range:
        """Request i's pieces (indices into the per-piece arrays), in step order."""
        return range(int(self._first_piece[i]), int(self._first_piece[i + 1]))

    def ctx_at(self, k: int, j: np.ndarray) -> np.ndarray:
        return self.ctx0[k] + self.slope[k] * j


def _pauses_applied(reqs: list[RequestSpan], report: set[str] | None) -> np.ndarray:
    """Per request, whether its pauses are cut into the batch (:data:`MAX_JOIN_PAUSES`)."""
    n_p = np.array([len(r.pauses) for r in reqs], dtype=np.int64)
    if int(n_p.sum()) <= MAX_JOIN_PAUSES:
        return n_p > 0
    told = np.array([report is None or r.request_id in report for r in reqs])
    ends = np.array([r.end_ns for r in reqs], dtype=np.int64)
    order = np.lexsort((-ends, ~told))          # the told first, then the latest ended
    keep = np.zeros(len(reqs), dtype=bool)
    keep[order[np.cumsum(n_p[order]) <= MAX_JOIN_PAUSES]] = True
    keep |= told & (n_p > 0)                    # a told request's own pauses always
    return keep


def _first_long_step(batch: _Batch, long_tokens: int) -> np.ndarray:
    """Per piece, the first decode step index at which ``ctx_at >= long_tokens`` (its
    ``dc_hi`` when none), exactly as the elementwise comparison decides it."""
    lo, hi = batch.dc_lo.astype(np.int64), batch.dc_hi.astype(np.int64)
    ctx0, slope = batch.ctx0, batch.slope
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(slope > 0, np.ceil((long_tokens - ctx0) / np.where(slope > 0, slope, 1.0)),
                     np.where(ctx0 >= long_tokens, -np.inf, np.inf))
    j = np.clip(np.nan_to_num(j, posinf=2**62, neginf=-2**62), lo, hi).astype(np.int64)
    # Rounding of the division: settle on the step the comparison itself gives.
    back = (j - 1 >= lo) & (ctx0 + slope * (j - 1) >= long_tokens)
    j = np.where(back, j - 1, j)
    fwd = (j < hi) & (ctx0 + slope * j < long_tokens)
    return np.where(fwd, j + 1, j)


#: Cells ([candidate, step] pairs) of one block of the culprit arrays (8 MB per float array).
_BLOCK_CELLS = 1 << 20


def _culprit_rows(batch: _Batch, cand: np.ndarray, js: np.ndarray, own_ctx: np.ndarray, long_tokens: int):
    """For candidates ``cand`` over R's decode steps ``js``: ``(cand kept, in_pf, is_long,
    long context, prefill tokens)``, [candidate, step] arrays, keeping only the candidates
    that are a culprit in at least one step (None when none is)."""
    cand = np.asarray(cand, dtype=np.int64)
    j = js[None, :]
    in_pf = (j >= batch.pf_lo[cand, None]) & (j < batch.pf_hi[cand, None])
    in_dc = (j >= batch.dc_lo[cand, None]) & (j < batch.dc_hi[cand, None])
    ctx = batch.ctx0[cand, None] + batch.slope[cand, None] * j
    is_long = in_dc & (ctx >= long_tokens) & (ctx > own_ctx[None, :])
    keep = is_long.any(axis=1) | in_pf.any(axis=1)
    if not keep.any():
        return None
    in_pf, is_long = in_pf[keep], is_long[keep]
    return (cand[keep], in_pf, is_long, np.where(is_long, ctx[keep], 0.0),
            np.where(in_pf, batch.chunk[cand[keep], None], 0.0))


def _fit(batch: _Batch, culprit_steps: np.ndarray) -> np.ndarray | None:
    """Least-squares step-time coefficients from the measured steps, when the window has
    steps with culprits and without, and the fit is determined on the features that vary."""
    # Steps with decoding members only: prefill-only steps are another regime, and the
    # baseline is only ever asked for a decode step.
    used = batch.n_dec > 0
    with_c = int(culprit_steps[used].sum())
    if with_c < MIN_FIT_STEPS or int(used.sum()) - with_c < MIN_FIT_STEPS:
        return None
    x, y = batch.features[used], batch.dur[used]
    coef, _res, rank, _sv = np.linalg.lstsq(x, y, rcond=None)
    varying = 1 + int(np.ptp(x[:, 1]) > 0) + int(np.ptp(x[:, 2]) > 0) + int(np.ptp(x[:, 3]) > 0)
    if rank < min(varying, 2):
        return None
    return coef


def join(requests: list[RequestSpan], steps: np.ndarray, kv: np.ndarray | None = None,
         estimate_step_ns=None, long_tokens: int = LONG_SEQUENCE_TOKENS,
         report: set[str] | None = None) -> list[RequestStory]:
    """The story of each request (see the module docstring). ``estimate_step_ns(decode_members,
    context_tokens, prefill_tokens) -> ns`` is the roofline fallback (arrays in, array out).
    ``report``: tell the stories of these request ids only; the others still count as
    co-batched members (the agent joins the requests due in a window against every
    request it still holds)."""
    reqs = sorted(requests, key=lambda r: r.start_ns)[-MAX_REQUESTS:]
    steps = np.sort(np.asarray(steps, dtype=STEP_DTYPE), order="start_ns")
    steps = steps[np.isin(steps["phase"], (PREFILL, DECODE, MIXED))]
    if not reqs:
        return []
    batch = _Batch(reqs, steps, _pauses_applied(reqs, report))
    n_steps = len(steps)
    # Culprit presence per step (for the fit's "both kinds"): a prefill chunk co-batched
    # with a decode, or a long sequence co-batched with another sequence.
    # A member is long from the first of its decode steps where its context (growing
    # linearly) reaches long_tokens: one interval each, summed by a difference array.
    long_cnt = np.zeros(n_steps + 1)
    first_long = _first_long_step(batch, long_tokens)
    has = first_long < batch.dc_hi
    _diff_add(long_cnt, first_long[has], batch.dc_hi[has], np.ones(int(has.sum())))
    long_cnt = np.cumsum(long_cnt)[:n_steps]
    culprit_steps = ((batch.pf > 0) & (batch.n_dec > 0)) | ((long_cnt > 0) & (batch.n_dec >= 2))
    coef = _fit(batch, culprit_steps) if n_steps else None
    source = SOURCE_MEASURED if coef is not None else (SOURCE_ESTIMATE if estimate_step_ns else SOURCE_NONE)
    kv = np.sort(np.asarray(kv if kv is not None else np.empty(0, KV_DTYPE), dtype=KV_DTYPE), order="ts_ns")
    out = []
    for i, r in enumerate(reqs):
        if report is not None and r.request_id not in report:
            continue
        arrival, sched, first, end = (int(v) for v in batch.intervals[i])
        mine = batch.pieces_of(i)
        added: dict[int, list] = {}          # culprit request index -> [ns, kinds]
        dragged_pf = dragged_long = 0.0
        has_culprits = False
        if batch.decode_steps[i] > 0:
            # R's decode steps (its pauses left out) and its context in each.
            js = np.concatenate([np.arange(batch.dc_lo[k], batch.dc_hi[k]) for k in mine])
            own_ctx = np.concatenate([batch.ctx_at(k, np.arange(batch.dc_lo[k], batch.dc_hi[k])) for k in mine])
            lo, hi = int(js[0]), int(js[-1]) + 1
            # Co-members of each of R's decode steps: other requests' pieces overlapping R's.
            cand = np.flatnonzero((batch.pf_hi > lo) & (batch.pf_lo < hi) | (batch.dc_hi > lo) & (batch.dc_lo < hi))
            cand = cand[batch.owner[cand] != i]
            # Only those that can be culprits: a prefill chunk inside R's decode steps, or a
            # sequence whose context reaches long_tokens there (it grows linearly, so its
            # largest is at the last step shared). The rest would add nothing below.
            ov_pf = (batch.pf_hi[cand] > lo) & (batch.pf_lo[cand] < hi)
            ov_dc = (batch.dc_hi[cand] > lo) & (batch.dc_lo[cand] < hi)
            last = np.minimum(batch.dc_hi[cand], hi) - 1
            cand = cand[ov_pf | (ov_dc & (batch.ctx0[cand] + batch.slope[cand] * last >= long_tokens))]
            # Every candidate's part in each of R's decode steps at once, as [candidate, step]
            # arrays, in row blocks of at most _BLOCK_CELLS cells (bounded memory): a first
            # pass sums the culprits' presence per step (the baseline needs all of them),
            # a second shares each step's added time among them.
            n_c = np.zeros(len(js))
            ctx_c = np.zeros(len(js))
            pf_c = np.zeros(len(js))
            tot = np.zeros(len(js))
            present_n = np.zeros(len(js))
            blocks = []
            step = max(1, _BLOCK_CELLS // max(len(js), 1))
            for k in range(0, len(cand), step):
                rows = _culprit_rows(batch, cand[k:k + step], js, own_ctx, long_tokens)
                if rows is None:
                    continue
                blocks.append(rows[0])
                _c, in_pf, is_long, c_ctx, pf_tok = rows
                n_c += is_long.sum(axis=0)
                ctx_c += c_ctx.sum(axis=0)
                pf_c += pf_tok.sum(axis=0)
                present_n += (in_pf | is_long).sum(axis=0)
            who = np.concatenate(blocks) if blocks else np.empty(0, np.int64)
            has_culprits = bool(len(who))
            if has_culprits and source != SOURCE_NONE:
                dur = batch.dur[js]
                if coef is not None:
                    base = (coef[0] + coef[1] * (batch.n_dec[js] - n_c) + coef[2] * (batch.ctx[js] - ctx_c)
                            + coef[3] * (batch.pf[js] - pf_c))
                    unit = (coef[1], coef[2], coef[3])
                else:
                    base = np.asarray(estimate_step_ns(batch.n_dec[js] - n_c, batch.ctx[js] - ctx_c,
                                                       batch.pf[js] - pf_c), dtype=np.float64)
                    full = np.asarray(estimate_step_ns(batch.n_dec[js], batch.ctx[js], batch.pf[js]),
                                      dtype=np.float64)
                    # The estimate's step time scaled to the measured one.
                    base = base * np.where(full > 0, dur / np.maximum(full, 1.0), 1.0)
                    unit = None

                def costs_of(in_pf, is_long, c_ctx, pf_tok, unit=unit):     # this iteration's unit
                    if unit is not None:
                        return np.maximum(unit[0] * is_long + unit[1] * c_ctx + unit[2] * pf_tok, 0.0)
                    return c_ctx + pf_tok
                extra = np.maximum(dur - base, 0.0)
                for k in range(0, len(who), step):
                    _c, in_pf, is_long, c_ctx, pf_tok = _culprit_rows(batch, who[k:k + step], js, own_ctx,
                                                                      long_tokens)
                    tot += costs_of(in_pf, is_long, c_ctx, pf_tok).sum(axis=0)
                for k in range(0, len(who), step):
                    c_idx, in_pf, is_long, c_ctx, pf_tok = _culprit_rows(batch, who[k:k + step], js, own_ctx,
                                                                         long_tokens)
                    costs = costs_of(in_pf, is_long, c_ctx, pf_tok)
                    present = (in_pf | is_long).astype(np.float64)
                    share = np.where(tot > 0, costs / np.where(tot > 0, tot, 1.0),
                                     present / np.maximum(present_n, 1.0))
                    per = share * extra
                    ns_rows = per.sum(axis=1)
                    pf_rows = (per * (in_pf & ~is_long)).sum(axis=1)
                    any_pf, any_long = in_pf.any(axis=1), is_long.any(axis=1)
                    for j, c in enumerate(c_idx):
                        dragged_pf += float(pf_rows[j])
                        dragged_long += float(ns_rows[j] - pf_rows[j])
                        # A culprit's pieces (it was paused between them) add up.
                        got = added.setdefault(int(batch.owner[c]), [0.0, set(), 0])
                        got[0] += float(ns_rows[j])
                        if any_pf[j]:
                            # Its size: what it prefilled here (a re-prefill: prompt + generated).
                            got[2] = max(got[2], int(round(batch.pf_tokens[c])))
                        got[1].update(n for n, m in (("prefill_chunk", any_pf[j]), ("long_sequence", any_long[j]))
                                      if m)
        culprits = sorted((Culprit(reqs[c].request_id, "+".join(k for k in ("prefill_chunk", "long_sequence")
                                                                 if k in kinds),
                                   int(round(ns)), tok or max(reqs[c].prompt_tokens, 0))
                           for c, (ns, kinds, tok) in added.items() if ns >= 1.0),
                          key=lambda x: -x.added_ns)[:MAX_CULPRITS]
        dragged = int(round(dragged_pf + dragged_long))
        # Paused time is out of its prefill and decode (it was in no step then).
        paused_pf = _pause_overlap_ns(r.pauses, sched, first)
        paused_dc = _pause_overlap_ns(r.pauses, first, end)
        # Its re-prefills after preemption are the preemption's price, not its decode.
        recompute_ns = int(round(batch.recompute_ns[i]))
        decode_ns = max(0, end - first - paused_dc - recompute_ns)
        q = kv[(kv["ts_ns"] >= arrival) & (kv["ts_ns"] <= max(sched, arrival))] if len(kv) else kv
        if len(kv) and not len(q) and sched > arrival:
            # No sample inside the wait: the one just before it describes it.
            k = int(np.searchsorted(kv["ts_ns"], arrival, "right")) - 1
            q = kv[k:k + 1] if k >= 0 else q
        kv_max = float(q["usage_ratio"].max()) if len(q) and sched > arrival else -1.0
        out.append(RequestStory(
            request_id=r.request_id, engine=r.engine, start_ns=arrival, end_ns=end,
            e2e_ns=r.e2e_ns if r.e2e_ns >= 0 else end - arrival,
            # -1 when the engine did not say (SGLang's metrics file has no queue time).
            queue_ns=sched - arrival if r.queue_ns >= 0 else -1,
            kv_usage_max_queued_ratio=kv_max, kv_full_while_queued=kv_max >= KV_FULL_RATIO,
            prefill_ns=max(0, first - sched - paused_pf), prefill_chunks=int(batch.prefill_steps[i]),
            decode_ns=decode_ns, decode_steps=int(batch.decode_steps[i]),
            ns_per_token=decode_ns / r.completion_tokens if r.completion_tokens > 0 else -1.0,
            dragged_ns=dragged, dragged_by_prefill_ns=int(round(dragged_pf)),
            dragged_by_long_ns=int(round(dragged_long)),
            dragged_source=source if has_culprits else SOURCE_NO_CULPRITS,
            alone_decode_ns=max(0, decode_ns - dragged), preemptions=r.preemptions,
            recovery_ns=r.recovery_ns if r.preemptions > 0 else (0 if r.preemptions == 0 else -1),
            prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens, culprits=culprits,
            trace_id=r.trace_id[:32], paused_ns=paused_pf + paused_dc,
            # every pause takes its re-prefills, then the first MAX_STORY_PAUSES are told (cut
            # first, the later pauses' re-prefills piled onto the last one told)
            pauses=batch.pauses_with_recompute(i, r.pauses)[:MAX_STORY_PAUSES],
            recompute_ns=recompute_ns, recompute_steps=int(batch.recompute_steps[i])))
    return out


def _p99(v: list[int]) -> int:
    return int(np.percentile(np.asarray(v, dtype=np.float64), 99)) if v else 0


def window_figures(stories: list[RequestStory], dropped: int = 0) -> WindowRequests:
    """Per-window aggregates: dragged-time share, p99 per segment, the top culprit, the
    re-prefill time after preemption and its share of the decode and re-prefill time."""
    if not stories:
        return WindowRequests(requests_dropped=dropped)
    dec = sum(s.decode_ns for s in stories)
    drg = sum(s.dragged_ns for s in stories)
    rec = sum(s.recompute_ns for s in stories)
    by: dict[str, list] = {}
    tokens = {}
    for s in stories:
        for c in s.culprits:
            by.setdefault(c.request_id, [0])[0] += c.added_ns
            tokens[c.request_id] = c.tokens
    top = max(by.items(), key=lambda kv: kv[1][0]) if by else ("", [0])
    sources = {s.dragged_source for s in stories}
    src = SOURCE_MEASURED if SOURCE_MEASURED in sources else (SOURCE_ESTIMATE if SOURCE_ESTIMATE in sources
                                                              else SOURCE_NONE)
    slowest = sorted(stories, key=lambda s: -s.e2e_ns)[:MAX_SLOWEST]
    e2e = np.array([s.e2e_ns for s in stories], dtype=np.float64) * 1e-9
    bucket = np.searchsorted(np.asarray(E2E_BOUNDS_S), e2e, "left")       # le: value <= bound
    counts = np.bincount(bucket, minlength=len(E2E_BOUNDS_S) + 1)
    worst: dict[int, RequestStory] = {}
    for b, s in zip(bucket.tolist(), stories):
        if b not in worst or s.e2e_ns > worst[b].e2e_ns:
            worst[b] = s
    exemplars = [Exemplar(b, s.request_id[:EXEMPLAR_ID_CHARS], s.trace_id, s.e2e_ns) for b, s in sorted(worst.items())]
    return WindowRequests(
        requests=len(stories), requests_dropped=dropped, decode_ns=dec, dragged_ns=drg,
        dragged_share_ratio=drg / dec if dec else 0.0,
        queue_p99_ns=_p99([s.queue_ns for s in stories if s.queue_ns >= 0]), prefill_p99_ns=_p99([s.prefill_ns for s in stories]),
        decode_p99_ns=_p99([s.decode_ns for s in stories]), dragged_p99_ns=_p99([s.dragged_ns for s in stories]),
        e2e_p99_ns=_p99([s.e2e_ns for s in stories]), top_culprit_id=top[0], top_culprit_added_ns=int(top[1][0]),
        top_culprit_tokens=int(tokens.get(top[0], 0)), dragged_source=src, slowest=slowest,
        e2e_total_ns=int(sum(s.e2e_ns for s in stories)), e2e_bucket_counts=[int(c) for c in counts],
        exemplars=exemplars, recompute_ns=rec, recompute_share_ratio=rec / (dec + rec) if dec + rec else 0.0)


def story_text(s: RequestStory) -> str:
    """One request's story in plain words with its numbers (``ridgeline why``)."""
    def sec(ns: int) -> str:
        return f"{ns / 1e9:.2f} s" if ns >= 1e8 else f"{ns / 1e6:.1f} ms"
    lines = [f"request {s.request_id} ({s.engine}): {sec(s.e2e_ns)} end to end, "
             f"{max(s.prompt_tokens, 0)} prompt tokens, {max(s.completion_tokens, 0)} generated."]
    q = f"queued {sec(s.queue_ns)}" if s.queue_ns >= 0 else "queue time: not reported by the engine"
    if s.kv_usage_max_queued_ratio >= 0:
        q += (f"; the KV cache was full then ({s.kv_usage_max_queued_ratio:.0%} used)" if s.kv_full_while_queued
              else f"; the KV cache was not full then (at most {s.kv_usage_max_queued_ratio:.0%} used)")
    lines.append(q + ".")
    lines.append(f"its own prefill: {sec(s.prefill_ns)} in {s.prefill_chunks} step(s)"
                 + (" (chunked)." if s.prefill_chunks > 1 else "."))
    per = f" ({s.ns_per_token / 1e6:.1f} ms per token)" if s.ns_per_token > 0 else ""
    lines.append(f"decode: {sec(s.decode_ns)} over {s.decode_steps} GPU step(s){per}"
                 + (", its pauses and re-prefills left out." if s.recompute_steps > 0
                    else ", its pauses left out." if s.paused_ns > 0 else "."))
    if s.dragged_source == SOURCE_NO_CULPRITS:
        lines.append("dragged: no; no prefill chunk or long sequence was batched with it.")
    elif s.dragged_source == SOURCE_NONE:
        lines.append("dragged: not known (no step-time baseline: the window has no steps without co-batched "
                     "culprits and no roofline model is configured).")
    elif s.dragged_ns > 0:
        alone_per = (f" ({s.alone_decode_ns / s.completion_tokens / 1e6:.1f} ms per token)"
                     if s.completion_tokens > 0 else "")
        est = " (ESTIMATE from the roofline model)" if s.dragged_source == SOURCE_ESTIMATE else \
            " (measured against this window's steps without them)"
        lines.append(f"dragged: {sec(s.dragged_ns)} of its decode was added by co-batched work{est}: "
                     f"{sec(s.dragged_by_prefill_ns)} by prefill chunks, {sec(s.dragged_by_long_ns)} by long "
                     f"sequences. Alone it would have decoded in {sec(s.alone_decode_ns)}{alone_per}.")
        for c in s.culprits:
            # A prefill chunk's size is what it prefilled (a re-prefill: prompt + generated).
            size = "tokens prefilled" if "prefill_chunk" in c.kind else "prompt tokens"
            lines.append(f"  culprit {c.request_id}: +{sec(c.added_ns)} ({c.kind.replace('_', ' ')}, "
                         f"{c.tokens} {size})")
    else:
        lines.append("dragged: no; nothing co-batched with it added measurable time.")
    if s.preemptions > 0:
        parts = [f"preempted {s.preemptions} time(s)"]
        if s.paused_ns > 0:
            parts.append(f": paused {sec(s.paused_ns)} by preemption (in no GPU step then: left out of its "
                         f"prefill and decode)")
        if s.recovery_ns >= 0:
            parts.append(f", {sec(s.recovery_ns)} to recover")
        if s.paused_ns > max(s.recovery_ns, 0) + 1_000_000:
            parts.append(f"; {sec(s.paused_ns - max(s.recovery_ns, 0))} of it never resumed (it ended preempted)")
        lines.append("".join(parts) + ".")
    elif s.preemptions == 0 and s.recompute_steps == 0:
        lines.append("never preempted.")
    if s.recompute_steps > 0:
        lines.append(f"recompute: {sec(s.recompute_ns)} in {s.recompute_steps} GPU step(s) re-prefilling its prompt "
                     f"and the tokens it had generated, after its preemption freed its KV cache (the preemption's "
                     f"price, left out of its decode).")
    if s.dragged_source == SOURCE_NONE:
        verdict = "not judged (co-batched with culprits, no baseline)"
    elif s.dragged_ns > DRAGGED_VERDICT_SHARE * max(s.decode_ns, 1):
        verdict = f"being dragged ({s.dragged_ns / max(s.decode_ns, 1):.0%} of its decode was added by others)"
    else:
        verdict = "slow on its own" if s.e2e_ns > 0 else "no time measured"
    lines.append(f"verdict: {verdict}.")
    return "\n".join(lines)

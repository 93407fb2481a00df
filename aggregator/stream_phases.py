"""Phase per kernel for a live stream, batch by batch, by the layered method of
:mod:`aggregator.phases` at a per-batch cost close to one pass over the kernels.

Contract of :class:`StreamPhaser` (one per event source, i.e. per append-only
:class:`probes.events.NameTable`):

* :meth:`StreamPhaser.map_batch` takes one batch (a :class:`probes.events.Trace`) and
  returns a :class:`BatchPhases`: phase code per kernel (``aggregator.phases`` codes),
  step index per kernel (local to the batch, -1 = none), and per step its device, span,
  phase, token counts and evidence.
* Kernel classes (signature, role, hint, tile, ...) are computed once per distinct name id
  and kept for the life of the source: name tables only grow.
* Kernel-only batches (no ranges, no CPU operators: what CUPTI and the simulator stream)
  are cut into steps by :func:`aggregator.steps.segment_kernels`; each step's *shape* (the
  sequence of name ids, grid x/y/z and block x/y of its kernels) is hashed, and the phase
  of each distinct shape (its hash and its length: runs of two lengths whose hashes
  collide are two shapes) is decided once by :func:`aggregator.phases.map_phases` run on
  that one step's kernels (``use_annotations=False``), then reused for every step of the
  same shape in this and later batches (a serving engine repeats a few step shapes).
  Bounded: at most ``max_shapes`` shapes are remembered (least recently used dropped).
* Batches with ranges (engine annotations, NVTX) or CPU operators go through the full
  :func:`aggregator.phases.map_phases` on the batch, annotations included.

Mixed steps: a shape decided prefill whose single varlen launch has room for one-token
decodes is relabelled mixed when the previous step of its device (remembered across batches,
``previous_step``) was LLM inference that ended less than 5 ms before, as
:func:`aggregator.phases.mixed_by_continuity` does over a whole trace.

Layer continuity: an unknown step that repeats a neighbour's layers takes its label
(:func:`aggregator.phases.same_layers_by_continuity`, the whole-trace rule): the neighbour
before a batch's first step is kept per device (``previous_layers``); one whose next step is
not decided in the batch is marked ``layers_wait`` and held by the caller with that step.

Approximations (stated in docs/benchmarks.md): a step is decided from its own kernels, so
device-wide context of a whole trace (e.g. "this device runs a training loop" seen in
another step) only counts within the step; a step cut by a batch edge is decided in two
pieces unless the caller carries the last step of each device into the next batch
(:class:`aggregator.windows.SourceFold` does, across batches and windows).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import numpy as np

from ridgeline.probes.events import Trace

from . import fold_native
from .phases import (
    DECODE,
    MIXED,
    OTHER,
    PHASE_NAMES,
    PREFILL,
    UNKNOWN,
    LayerStep,
    layers_repeated,
    map_phases,
    mixed_by_continuity,
)
from .signatures import ROLE_TRAINING, KernelClasses, classify_kernels, name_classes_generation
from .steps import segment_kernels

_MUL = np.uint64(0x9E3779B97F4A7C15)       # odd constants of a multiplicative hash
_C = [np.uint64(c) for c in (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F,
                              0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3)]
# The same constants as int64 scalars (their bits): the per-kernel products wrap alike.
_CI = [np.array(c, dtype=np.uint64).view(np.int64)[()] for c in _C]
_HASH_CONSTS = np.array(_C + [_MUL], dtype=np.uint64)     # rl_map_runs' hash: C0..C5, MUL
_NONE = np.empty(0, dtype=np.int64)


@dataclass
class BatchPhases:
    """Phases of one batch; arrays aligned with the batch's kernels."""
    kernel_phase: np.ndarray                  # uint8 phase code
    kernel_step: np.ndarray                   # int32 step index in ``steps`` (-1: none)
    steps: list = field(default_factory=list)  # StreamStep
    shape_hits: int = 0                        # steps decided from a remembered shape
    shape_misses: int = 0                      # steps that ran map_phases
    # Indices of the kernels that belong to a step, sorted by (step, start); None when
    # the batch went through the full mapper.
    order: np.ndarray | None = None


@dataclass
class StreamStep:
    device: int
    start_ns: int
    end_ns: int
    phase: int
    prefill_tokens: int | None
    decode_tokens: int | None
    evidence: str
    mixed_slots: int = 0
    source: str = "kernels"          # "annotation" where an engine's step annotation decided it
    tokens: int | None = None        # all tokens as the kernels show them (aggregator.phases.Step)
    # Unknown, and its layers could take its next step's phase (aggregator.phases
    # same_layers_by_continuity), which this batch has not decided: the caller holds it
    # with the device's open step (aggregator.windows.SourceFold).
    layers_wait: bool = False


@dataclass
class _Shape:
    phase: np.ndarray          # per kernel of the step, in (start, index) order
    prefill_tokens: int | None
    decode_tokens: int | None
    step_phase: int
    evidence: str
    inference_only: bool = False      # holds a kernel only serving engines launch
    mixed_slots: int = 0              # one-token sequences possible in its varlen prefill launch
    tokens: int | None = None         # all its tokens as its kernels show them
    layer_candidate: bool = False     # unknown, with layers a neighbour's could label (LayerStep.candidate)


class _GatheredClasses:
    """The :class:`KernelClasses` of some kernels, each per-kernel array gathered from the
    per-name arrays (``per_name[f][look]``) when first read: segmentation reads four of
    the fourteen, and gathering all of them was a pass over the kernels each."""

    def __init__(self, signatures, per_name: dict, name_ids: np.ndarray, slots: int, memo: dict | None = None):
        self.signatures = signatures
        self._per_name, self._name_ids, self._slots = per_name, name_ids, slots
        self._look = None
        # Values derived from the per-name arrays alone (aggregator.steps._scan_flags),
        # shared by every batch until the phaser's name table changes.
        self.memo = memo if memo is not None else {}

    def per_name(self) -> SimpleNamespace:
        """The per-name arrays themselves, one row per name slot (the last: "no name"), for
        a pass that looks names up itself (aggregator.steps.segment_kernels' native scan)."""
        return SimpleNamespace(**{f: a[:self._slots] for f, a in self._per_name.items()})

    def of(self, field: str, name_ids: np.ndarray) -> np.ndarray:
        """``field`` of the kernels with these name ids (a few: no pass over the batch)."""
        nid = np.asarray(name_ids, dtype=np.int64)
        return self._per_name[field][np.where((nid >= 0) & (nid < self._slots - 1), nid, self._slots - 1)]

    def any_name(self, field: str, value) -> bool:
        """Whether any name slot has ``field == value``: False answers for every kernel
        without a pass over them."""
        return bool((self._per_name[field][:self._slots] == value).any())

    def __getattr__(self, name: str) -> np.ndarray:
        per = self.__dict__.get("_per_name")
        if per is None or name not in per:
            raise AttributeError(name)
        if self._look is None:
            # The name slot of each kernel, computed when a per-kernel array is first read
            # (the native step cut reads none).
            nid = np.asarray(self._name_ids, dtype=np.int64)
            self._look = np.where((nid >= 0) & (nid < self._slots - 1), nid, self._slots - 1)
        a = per[name][self._look]
        self.__dict__[name] = a
        return a


class StreamPhaser:
    """Streaming phase mapper of one source (see the module docstring)."""

    def __init__(self, names, max_shapes: int = 4096):
        self.names = names
        self.max_shapes = max_shapes
        self._shapes: OrderedDict[tuple[int, int], _Shape] = OrderedDict()   # (hash, length) -> shape
        self._cls: dict[str, np.ndarray] = {}
        self._cls_n = 0
        self._cls_gen = 0
        self._signatures = None
        self._pw = np.ones(1, dtype=np.uint64)
        self._memo: dict = {}          # _GatheredClasses.memo of the current name table
        self.map_phases_calls = 0
        self.training_devices: set[int] = set()
        # device -> the last few (start_ns, end_ns, phase) mapped: a prefill launch that
        # continues a running batch is mixed (aggregator.phases.mixed_by_continuity).
        self.previous_step: dict[int, list[tuple[int, int, int]]] = {}
        # device -> start of the earliest step mapped so far (by either path): a later step
        # of a later batch is not the first of the recording (mixed_by_continuity).
        self.first_step_ns: dict[int, int] = {}
        # device -> its last steps mapped (by either path), as the layer-continuity rule
        # reads them: the neighbour before a batch's first step (same_layers_by_continuity).
        self.previous_layers: dict[int, list[LayerStep]] = {}

    # -- kernel classes per name id, cached --------------------------------------------
    def classes(self, name_ids: np.ndarray) -> KernelClasses:
        """Kernel classes of kernels with these name ids (gathered from per-name arrays).

        Each name is classified once, when it first appears in the (append-only) table:
        only the ids added since the last call are matched, so the cost over the life of
        the source is linear in the names (it re-classified the whole table each time the
        table grew: a peer adding names one batch at a time made it quadratic).
        """
        n_names = len(self.names)
        gen = name_classes_generation(self.names)
        if gen != self._cls_gen:
            # rows stored as stand-ins (a peer's budget spent) were replaced by real ones
            # (aggregator.signatures.store_name_classes): gather every name again
            self._cls_gen, self._cls_n = gen, 0
        if n_names + 1 > self._cls_n:
            from ridgeline.probes.events import KERNEL_DTYPE, empty
            first = max(self._cls_n - 1, 0)
            # a fake trace with one kernel per new name id and one without a name
            k = empty(KERNEL_DTYPE, n_names - first + 1)
            k["name_id"][:-1] = np.arange(first, n_names)
            k["name_id"][-1] = -1
            kc = classify_kernels(Trace(kernels=k, names=self.names))
            self._signatures = kc.signatures
            for f in fields(KernelClasses):
                if f.name == "signatures":
                    continue
                a = getattr(kc, f.name)
                old = self._cls.get(f.name)
                if old is None or len(old) < n_names + 1:
                    # capacity doubles: a table growing by one name per batch copies O(n) in all
                    grown = np.empty(max(2 * (n_names + 1), 64), dtype=a.dtype)
                    if old is not None:
                        grown[:first] = old[:first]
                    old = self._cls[f.name] = grown
                old[first:n_names + 1] = a          # the new names, then "no name" at index n_names
            self._cls_n = n_names + 1
            self._memo = {}
        return _GatheredClasses(self._signatures, self._cls, name_ids, self._cls_n, self._memo)

    # -- batches -----------------------------------------------------------------------
    @staticmethod
    def kernels_only(trace: Trace) -> bool:
        """Whether :meth:`map_batch` cuts this batch into steps from its kernels alone
        (no ranges, no CPU operators), so that :meth:`segment` may come first."""
        return not (len(trace.ranges) or len(trace.cpu_ops))

    def segment(self, trace: Trace):
        """The steps :meth:`map_batch` would cut a kernels-only batch into (its kernel
        classes and :func:`aggregator.steps.segment_kernels`), for a caller that decides
        which steps to hold back before any is phase-mapped."""
        kc = self.classes(trace.kernels["name_id"])
        return kc, segment_kernels(trace, kc)

    def map_batch(self, trace: Trace, seg=None, skip: np.ndarray | None = None) -> BatchPhases:
        """Phases of one batch. ``seg``: :meth:`segment`'s answer for this batch (a
        kernels-only batch); ``skip``: per step of it (and one more slot), True for the
        steps not to decide now: the caller holds them back and maps them whole later, so
        deciding their partial shape would only be thrown away (each was a new shape, a
        full phase mapping, every fold). Skipped steps keep UNKNOWN phases, are not in
        ``order`` and leave no trace in the continuity history."""
        k = trace.kernels
        n = len(k)
        if n == 0:
            return BatchPhases(np.empty(0, np.uint8), np.empty(0, np.int32))
        if not self.kernels_only(trace):
            return self._full(trace)
        kc, seg = seg if seg is not None else self.segment(trace)
        if fold_native.REFERENCE:
            return self._map_reference(trace, kc, seg, skip)
        # The kept kernels in (step, start) order, their step runs and shape hashes in one
        # native pass (fold_native.map_runs; a batch already in that order, one device in
        # time order, needs no sort), the same values as _map_reference's numpy.
        ks = np.asarray(seg.kernel_step, dtype=np.int32)
        sk = skip if skip is not None and skip.any() else None
        runs = fold_native.map_runs(k, ks, None, sk, _HASH_CONSTS)
        if runs is None:
            st = k["start_ns"]
            key = (ks.astype(np.int64) << 40) | np.minimum(st - st.min(), (1 << 40) - 1)
            runs = fold_native.map_runs(k, ks, np.argsort(key, kind="stable"), sk, _HASH_CONSTS)
        order, first, step_ids, h = runs
        return self._map_steps(trace, kc, seg, skip, ks, order, first, step_ids, h)

    def _map_reference(self, trace: Trace, kc, seg, skip) -> BatchPhases:
        """map_batch's kernels-only path in numpy: the reference of fold_native.map_runs and
        fold_native.map_phases (aggregator/native/ridgeline_map.c), which the tests compare
        with (tests/test_stream_map_native.py)."""
        k = trace.kernels
        n = len(k)
        ks = np.asarray(seg.kernel_step, dtype=np.int64)
        # Kernels of each step in (step, start) order; a step's shape is the sequence
        # of its kernels' name ids and launch dimensions.
        # One stable sort of a composite key (steps, then start time relative to the
        # batch): the batch is mostly in order already, which a stable sort exploits.
        st = k["start_ns"]
        key = (ks << 40) | np.minimum(st - st.min(), (1 << 40) - 1)
        if n < 2 or bool((key[1:] >= key[:-1]).all()):
            # Already in (step, start) order (one device, in time order): no sort, no gather.
            order, sks = np.arange(n), ks
        else:
            order = np.argsort(key, kind="stable")
            sks = ks[order]
        on = sks >= 0
        if skip is not None and skip.any():
            on &= ~skip[sks]                # sks -1 reads the extra slot
        if not on.all():
            order, sks = order[on], sks[on]
        if not len(order):
            return self._map_steps(trace, kc, seg, skip, ks, order, order, order, order)
        first = np.flatnonzero(np.r_[True, sks[1:] != sks[:-1]])
        lens = np.diff(np.r_[first, len(sks)])
        pos = np.arange(len(sks)) - np.repeat(first, lens)
        identity = len(order) == n and sks is ks
        h = self._hashes_reference(k, order, identity, first, lens, pos)
        return self._map_steps(trace, kc, seg, skip, ks, order, first, sks[first], h, pos)

    def _map_steps(self, trace: Trace, kc, seg, skip, ks, order, first, step_ids, h, pos=None) -> BatchPhases:
        """The rest of map_batch from the kept kernels in (step, start) order (``order``),
        their step runs (``first`` positions in ``order``, ``step_ids``) and shape hashes
        ``h``: each distinct shape decided once, each kernel's phase from its shape (numpy
        when ``pos``, each kernel's position in its run, is given: the reference; else
        fold_native.map_phases), the steps and their continuity relabel."""
        k = trace.kernels
        n = len(k)
        phase = np.full(n, UNKNOWN, dtype=np.uint8)
        if not len(order):
            return BatchPhases(phase, ks.astype(np.int32), order=order)
        lens = np.diff(np.r_[first, len(order)])
        # Distinct shapes by (hash, length), the cache's key: runs of different lengths
        # whose hashes collide (the hash is linear in fields a peer chooses) are two shapes,
        # each decided once and remembered, and every run's shape has exactly its length,
        # which the native copy (rl_map_phases) relies on. np.unique's (first occurrence,
        # inverse) by one stable sort of both keys, hash first: the shapes come in hash
        # order, as np.unique of the hashes alone gave them.
        by = np.lexsort((lens, h))
        hs, ls = h[by], lens[by]
        new = np.empty(len(by), dtype=bool)
        new[0] = True
        np.not_equal(hs[1:], hs[:-1], out=new[1:])
        new[1:] |= ls[1:] != ls[:-1]
        rep = by[new]
        inv = np.empty(len(by), dtype=np.int64)
        inv[by] = np.cumsum(new) - 1
        shapes: list[_Shape] = []
        misses = 0
        for key in zip(hs[new].tolist(), ls[new].tolist()):
            sh = self._shapes.get(key)
            if sh is None:
                j = int(rep[len(shapes)])          # the shape's first run
                sh = self._decide(trace, order[first[j]:first[j] + lens[j]])
                self._shapes[key] = sh
                if len(self._shapes) > self.max_shapes:
                    self._shapes.popitem(last=False)
                misses += 1
            else:
                self._shapes.move_to_end(key)
            shapes.append(sh)
        hits = len(first) - misses
        # Per-kernel phases: the remembered shape's phase at the kernel's position.
        offs = np.r_[0, np.cumsum([len(x.phase) for x in shapes])][:-1]
        flat = np.concatenate([x.phase for x in shapes])
        if pos is not None:
            kph = flat[offs[np.repeat(inv, lens)] + pos]
        else:
            fold_native.map_phases(order, first, offs[inv], flat, phase)
        # Device-wide training context, as map_phases has it over a whole trace: a device
        # seen running backward/optimizer kernels in this stream (so far) makes its steps
        # without an inference-only kernel "other".
        # (No name of the source is a training kernel, the serving case: no per-kernel pass.)
        if kc.any_name("role", ROLE_TRAINING):
            train = kc.role == ROLE_TRAINING
            if train.any():
                self.training_devices.update(np.unique(k["device"][train]).tolist())
        ctx = np.zeros(len(first), dtype=bool)
        if self.training_devices:
            step_dev = k["device"][order[first]]
            inf_only = np.array([x.inference_only for x in shapes], dtype=bool)
            ctx = np.isin(step_dev, list(self.training_devices)) & ~inf_only[inv]
        if pos is not None:
            if ctx.any():
                kph = np.where(np.repeat(ctx, lens), np.uint8(OTHER), kph)
            phase[order] = kph
        elif ctx.any():
            phase[order[np.repeat(ctx, lens)]] = OTHER
        # Step indices are the segmentation's (contiguous from 0 in this batch). Each
        # shape's step fields are laid out once (segment_kernels' segments hold Python ints).
        segs = seg.segments
        steps = [None] * len(segs)
        tails = [(x.step_phase, x.prefill_tokens, x.decode_tokens, x.evidence, x.mixed_slots, "kernels", x.tokens)
                 for x in shapes]
        if ctx.any():
            other = (OTHER, None, None, "", 0, "kernels", None)
            for j, u, c in zip(step_ids.tolist(), inv.tolist(), ctx.tolist()):
                sg = segs[j]
                steps[j] = StreamStep(sg.device, sg.start_ns, sg.end_ns, *(other if c else tails[u]))
                if c:
                    steps[j].evidence = (f"other: device {sg.device} runs a training loop (backward/optimizer "
                                         "kernels in this stream) and this step has no inference-only kernel")
        else:
            for j, u in zip(step_ids.tolist(), inv.tolist()):
                sg = segs[j]
                steps[j] = StreamStep(sg.device, sg.start_ns, sg.end_ns, *tails[u])
        if len(step_ids) != len(segs):
            for j, sg in enumerate(segs):      # a segment without kernels (none expected), or skipped
                if steps[j] is None:
                    steps[j] = StreamStep(sg.device, sg.start_ns, sg.end_ns, UNKNOWN, None, None, "")
        cand = np.fromiter((x.layer_candidate for x in shapes), bool, len(shapes))
        self._layer_continuity(k, kc, steps, step_ids, order, first, lens, phase,
                               cand[inv] if cand.any() else None)
        # Steps in time order per device (segments are per device, in time order).
        if skip is not None and skip[:len(steps)].any():
            at = np.flatnonzero(~skip[:len(steps)]).tolist()
            decided = [steps[j] for j in at]
            relabel = [at[i] for i in self._continuity(decided, shapes)]
        else:
            relabel = self._continuity(steps, shapes)
        for j in relabel:
            steps[j].prefill_tokens = steps[j].decode_tokens = None
            p = int(np.searchsorted(step_ids, j))
            if p < len(step_ids) and step_ids[p] == j:
                at = order[first[p]:first[p] + lens[p]]
                phase[at] = np.where(phase[at] == PREFILL, np.uint8(MIXED), phase[at])
        return BatchPhases(phase, ks.astype(np.int32), steps, hits, misses, order=order)

    def _layer_continuity(self, k, kc, steps: list, step_ids, order, first, lens, phase, cand) -> None:
        """:func:`aggregator.phases.same_layers_by_continuity` over the decided steps of a
        kernels-only batch (``step_ids``: those holding kernels in ``order``, one run each;
        the skipped ones, held by the caller, are not decided): the neighbour before a
        device's first step is the last one of an earlier batch (``previous_layers``). An
        unknown step whose next step is not decided here gets ``layers_wait``. The relabelled
        steps' kernels all take the step's new phase, as the whole-trace mapper's do.
        ``cand``: per run, whether its shape is a layer candidate (None: none is, the steady
        serving case: only ``previous_layers`` moves on, one step per device)."""
        if not len(step_ids):
            return
        run_of: dict[int, int] = {}
        seen: dict[int, LayerStep] = {}

        def at(j: int) -> LayerStep:
            if j not in seen:
                st = steps[j]
                if st.phase in (PREFILL, DECODE, UNKNOWN):
                    p = run_of[j]
                    idx = order[first[p]:first[p] + lens[p]]
                    nid = k["name_id"][idx]
                    seen[j] = LayerStep(int(st.start_ns), int(st.phase), j, nid, kc.of("role", nid),
                                        k["end_ns"][idx] - k["start_ns"][idx])
                else:
                    # No neighbour and no candidate: its kernels are never read.
                    seen[j] = LayerStep(int(st.start_ns), int(st.phase), j, _NONE, _NONE, _NONE)
            return seen[j]

        def remember(dev: int, first_ns: int, keep: list[int]) -> None:
            # Entries of steps mapped again here (held ones) give way to their new mapping.
            hist = [h for h in self.previous_layers.get(dev, []) if h.start_ns < first_ns]
            self.previous_layers[dev] = (hist + [at(j) for j in keep])[-3:]

        if cand is None:
            # Runs are per device in time order: each device's first and last run.
            dev_of = k["device"][order[first]]
            if len(dev_of) == 1 or dev_of[0] == dev_of[-1] and (dev_of == dev_of[0]).all():
                spans = [(int(dev_of[0]), 0, len(dev_of) - 1)]
            else:
                devs, lo = np.unique(dev_of, return_index=True)
                hi = len(dev_of) - 1 - np.unique(dev_of[::-1], return_index=True)[1]
                spans = list(zip(devs.tolist(), lo.tolist(), hi.tolist()))
            for d, a, b in spans:
                j = int(step_ids[b])
                run_of[j] = b
                remember(d, int(steps[int(step_ids[a])].start_ns), [j])
            return
        run_of.update(zip(step_ids.tolist(), range(len(step_ids))))
        by_device: dict[int, list[int]] = {}
        for j, st in enumerate(steps):          # per device in time order (segment_kernels)
            by_device.setdefault(st.device, []).append(j)
        found = []
        for dev, seq in by_device.items():
            done = [j for j in seq if j in run_of]
            if not done:
                continue
            hist = [h for h in self.previous_layers.get(dev, []) if h.start_ns < steps[done[0]].start_ns]
            for p, j in enumerate(seq):
                if j not in run_of or not cand[run_of[j]] or steps[j].phase != UNKNOWN:
                    continue
                # A held step (skipped) is each device's last, so it never comes before a
                # decided one; were one there, it would be no neighbour (not decided).
                after = seq[p + 1] if p + 1 < len(seq) and seq[p + 1] in run_of else None
                steps[j].layers_wait = after is None
                nb_before = (at(seq[p - 1]) if seq[p - 1] in run_of else None) if p else (hist[-1] if hist else None)
                nb_after = at(after) if after is not None else None
                if not any(nb is not None and nb.phase in (PREFILL, DECODE) for nb in (nb_before, nb_after)):
                    continue
                hit = layers_repeated(at(j), nb_before, nb_after)
                if hit is not None:
                    found.append((j, *hit))
            # The last step kept, and the one before it when the last waits (the caller
            # maps the last again with the next batch, after the one before it).
            remember(dev, int(steps[done[0]].start_ns), done[-2:] if steps[done[-1]].layers_wait else done[-1:])
        for j, nb, text in found:
            st = steps[j]
            st.evidence = f"{PHASE_NAMES[nb.phase]}: {text}; its kernels alone: {st.evidence}"
            st.phase = nb.phase
            p = run_of[j]
            phase[order[first[p]:first[p] + lens[p]]] = nb.phase

    def _hashes_reference(self, k, order, identity: bool, first, lens, pos) -> np.ndarray:
        """The numpy reference of ``rl_map_runs``' hash (aggregator/native/ridgeline_map.c):
        per step, the sum of its kernels' values times MUL**position, xor its length * MUL."""
        n = len(k)
        if len(self._pw) < int(lens.max()):
            m = int(lens.max()) * 2
            pw = np.empty(m, dtype=np.uint64)
            pw[0] = 1
            with np.errstate(over="ignore"):
                for i in range(1, m):       # once per new maximum step length
                    pw[i] = pw[i - 1] * _MUL
            self._pw = pw
        with np.errstate(over="ignore"):
            # Per-kernel value in batch order (strided column reads), then one gather.
            # In int64 (two's complement: the same bits as the uint64 products of the
            # sign-extended columns), each column multiplied straight from its int32 field.
            # grid.z (batched-GEMM heads) and block.y (GEMV rows per block) are evidence too.
            v = k["name_id"].astype(np.int64)
            v += 1
            v *= _CI[0]
            tmp = np.empty(n, dtype=np.int64)
            for c, f in zip(_CI[1:], ("grid_x", "grid_y", "block_x", "grid_z", "block_y")):
                np.multiply(k[f], c, out=tmp, dtype=np.int64)
                v += tmp
            v = v.view(np.uint64)
            h = np.add.reduceat((v if identity else v[order]) * self._pw[pos], first)
            h = h ^ (lens.astype(np.uint64) * _MUL)
        return h

    def _continuity(self, decided: list, shapes: list) -> list[int]:
        """``mixed_by_continuity(decided, self.previous_step, self.first_step_ns)``, then
        :meth:`_saw` of ``decided``: the same relabel and the same history. When no shape of
        the batch can be relabelled (no prefill shape with one-token slots: the steady
        serving case), the relabel is empty and only the history moves on: per device, its
        steps (one run of ``decided``, strictly increasing starts, as segment_kernels cuts
        them) follow the remembered steps that started before the first of them, the last
        four kept, which is what the step-by-step update leaves; else (and as the reference,
        fold_native.REFERENCE) the step-by-step way."""
        if fold_native.REFERENCE or not decided or any(x.step_phase == PREFILL and x.mixed_slots > 0 for x in shapes):
            relabel = mixed_by_continuity(decided, self.previous_step, self.first_step_ns)
            self._saw(decided)
            return relabel
        runs: list[tuple[int, list]] = []
        for x in decided:
            if runs and runs[-1][0] == x.device:
                runs[-1][1].append((x.start_ns, x.end_ns, x.phase))
            else:
                runs.append((x.device, [(x.start_ns, x.end_ns, x.phase)]))
        if len({d for d, _ in runs}) != len(runs) or not all(
                a[0] < b[0] for _, ent in runs for a, b in zip(ent, ent[1:])):
            # A device in two runs, or two steps starting together: step by step.
            relabel = mixed_by_continuity(decided, self.previous_step, self.first_step_ns)
            self._saw(decided)
            return relabel
        last, first_ns = self.previous_step, self.first_step_ns
        for d, ent in runs:
            t = ent[0][0]
            last[d] = ([h for h in last.get(d, ()) if h[0] < t] + ent[-4:])[-4:]
            if t < first_ns.get(d, t + 1):
                first_ns[d] = t
        return []

    def _saw(self, steps) -> None:
        for x in steps:
            d, t = int(x.device), int(x.start_ns)
            if t < self.first_step_ns.get(d, t + 1):
                self.first_step_ns[d] = t

    def _decide(self, trace: Trace, idx: np.ndarray) -> _Shape:
        """Phase of one step's kernels by the full layered method, kept as a shape."""
        self.map_phases_calls += 1
        kern = trace.kernels[idx]
        # With the step's launch records: the mapper's own step cut reads them (a GPU gap
        # inside one host burst is no boundary, aggregator.steps HOST_TOGETHER_NS), so the
        # one step the batch segmentation found stays one step here.
        api = trace.api[np.isin(trace.api["correlation_id"], kern["correlation_id"])] if len(trace.api) else trace.api
        sub = Trace(kernels=kern, api=api, names=self.names, devices=trace.devices, meta=trace.meta)
        pm = map_phases(sub, use_annotations=False, first_step_unknown_history=False)
        ph = np.asarray(pm.kernel_phase, dtype=np.uint8)
        inf_only = bool(self.classes(sub.kernels["name_id"]).inference_only.any())
        pre = [s.prefill_tokens for s in pm.steps if s.prefill_tokens is not None]
        dec = [s.decode_tokens for s in pm.steps if s.decode_tokens is not None]
        # The step's phase: the phase holding most of its kernels.
        main = int(np.bincount(ph, minlength=5).argmax()) if len(ph) else UNKNOWN
        ev = next((s.evidence[0] for s in pm.steps if s.phase == main and s.evidence), "")
        slots = max((s.mixed_slots for s in pm.steps if s.phase == PREFILL), default=0)
        tok = [s.tokens for s in pm.steps if s.tokens is not None]
        # Whether its layers could take a neighbour's phase: its names and roles alone decide.
        nid = sub.kernels["name_id"]
        cand = main == UNKNOWN and LayerStep(0, main, 0, nid, self.classes(nid).role,
                                                    np.ones(len(nid), np.int64)).candidate
        return _Shape(ph, sum(pre) if pre else None, sum(dec) if dec else None, main,
                      f"{PHASE_NAMES.get(main, str(main))}: {ev}" if ev else PHASE_NAMES.get(main, str(main)),
                      inf_only, slots, sum(tok) if tok else None, cand)

    def _full(self, trace: Trace) -> BatchPhases:
        """Annotated batches: the whole layered method on the batch."""
        self.map_phases_calls += 1
        pm = map_phases(trace, use_annotations=True, first_step_ns=self.first_step_ns,
                        previous_layers=self.previous_layers)
        self._saw(pm.steps)
        # The caller holds each device's last step (its open one): a layer candidate just
        # before it, or that step itself, waits for it to be decided whole.
        last_two: dict[int, list[int]] = {}
        for i, s in enumerate(pm.steps):
            last_two[int(s.device)] = (last_two.get(int(s.device), []) + [i])[-2:]
        wait = {i for seq in last_two.values() for i in seq if pm.steps[i].layer_candidate}
        steps = [StreamStep(int(s.device), int(s.start_ns), int(s.end_ns), int(s.phase), s.prefill_tokens,
                            s.decode_tokens, f"{PHASE_NAMES.get(int(s.phase), str(s.phase))}: "
                            + (s.evidence[0] if s.evidence else ""), source=s.source, tokens=s.tokens,
                            layers_wait=i in wait)
                 for i, s in enumerate(pm.steps)]
        return BatchPhases(np.asarray(pm.kernel_phase, dtype=np.uint8), np.asarray(pm.kernel_step, dtype=np.int32),
                           steps, 0, len(steps))

"""Kernel-name signatures: what a kernel's name (and launch grid) says about the phase.

The table lives in ``aggregator/data/kernel_signatures.toml`` (one entry per kernel family,
with the source file that defines it and a trace where it was seen). This module loads it
and classifies the kernels of a :class:`probes.events.Trace` column-wise: names are
matched once per distinct kernel name (``NameTable.ids_matching``), and every per-kernel
array is then a gather by ``name_id`` (``np.isin`` / fancy indexing), never a Python loop
over kernels.
"""
from __future__ import annotations

import threading
import tomllib
import weakref
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import re2

from ridgeline.probes.errors import InputError
from ridgeline.probes.events import NameTable, Trace

DATA_FILE = Path(__file__).parent / "data" / "kernel_signatures.toml"

#: Memory of one compiled name pattern (RE2's DFA cache; past it RE2 runs its NFA, still
#: linear). RE2's default is 8 MiB; some 70 patterns at that would be a large share of the
#: unit's MemoryMax.
NAME_REGEX_MAX_MEM_BYTES = 1 << 20


def _re2_options() -> re2.Options:
    o = re2.Options()
    o.max_mem = NAME_REGEX_MAX_MEM_BYTES
    o.log_errors = False        # a refused pattern is one InputError line, not a C++ log line
    return o


_RE2_OPTIONS = _re2_options()


@lru_cache(maxsize=1024)
def name_regex(pattern: str):
    """``pattern`` compiled by RE2, for every regular expression applied to kernel names.

    Names come from any local process (the CUPTI socket) and from traces of unknown origin;
    Python's ``re`` backtracks, and a 4 kB name built to match the start of a signature
    (``fmhaSm1KernelKernel...``) took it over a second per pattern. RE2 has no
    backtracking: a search is linear in the name whatever the pattern. It refuses
    look-around and back-references (raises ``re2.error``), which is why the table uses
    neither. ``\\w``, ``\\d`` and ``\\b`` are ASCII classes in RE2 (kernel names are ASCII).
    """
    return re2.compile(pattern, _RE2_OPTIONS)

# Roles (uint8 codes, 0 = no signature matched).
ROLE_NONE = 0
ROLE_ATTENTION = 1
ROLE_ATTENTION_AUX = 2
ROLE_PER_TOKEN = 3
ROLE_GEMM = 4
ROLE_GEMV = 5
ROLE_SAMPLING = 6
ROLE_TRAINING = 7
ROLE_NON_LLM = 8          # convolutions, pooling, recommendation-model embedding bags
ROLE_COLLECTIVE = 9
ROLE_SOFTMAX = 10         # a plain softmax kernel (eager attention: batched GEMM, softmax, batched GEMM)
ROLE_CODES = {"softmax": ROLE_SOFTMAX, "attention": ROLE_ATTENTION, "attention_aux": ROLE_ATTENTION_AUX, "per_token": ROLE_PER_TOKEN,
              "gemm": ROLE_GEMM, "gemv": ROLE_GEMV, "sampling": ROLE_SAMPLING, "training": ROLE_TRAINING,
              "non_llm": ROLE_NON_LLM, "collective": ROLE_COLLECTIVE}

# Phase hints; numerically identical to aggregator.phases labels (0 = neutral/unknown).
HINT_NEUTRAL, HINT_PREFILL, HINT_DECODE, HINT_MIXED, HINT_OTHER = 0, 1, 2, 3, 4
HINT_CODES = {"neutral": HINT_NEUTRAL, "prefill": HINT_PREFILL, "decode": HINT_DECODE,
              "mixed": HINT_MIXED, "other": HINT_OTHER}

WEAK, MEDIUM, STRONG = 1, 2, 3
STRENGTH_CODES = {"weak": WEAK, "medium": MEDIUM, "strong": STRONG}
STRENGTH_NAMES = {v: k for k, v in STRENGTH_CODES.items()}

GRID_NONE, GRID_QUERY_BLOCKS, GRID_TOKENS, GRID_TILE, GRID_ROWS, GRID_WARP_ROWS = 0, 1, 2, 3, 4, 5
GRID_CODES = {"": GRID_NONE, "query_blocks": GRID_QUERY_BLOCKS, "tokens": GRID_TOKENS, "tile": GRID_TILE,
              "rows": GRID_ROWS, "warp_rows": GRID_WARP_ROWS}
# PyTorch's softmax_warp_forward<input_t, output_t, acc_t, log2_elements, ...>: the fourth
# template argument is log2 of the padded row length; it sets the rows per 128-thread block.
_SOFTMAX_LOG2 = name_regex(r"softmax_warp_forward<[^,<>]+,[^,<>]+,[^,<>]+,\s*(\d+)\s*,")

# GEMM tile spelled in the kernel name; the first group pair is the (M, N) tile.
# Patterns from reference/kernel-signatures.md section 8 (cuBLAS xmma, CUTLASS, nvjet,
# hipBLASLt macro tiles, trtllm-gen bmm, Ampere sgemm).
_TILE_PATTERNS = [name_regex(p) for p in (
    r"tilesize(\d+)x(\d+)x\d+",
    r"nvjet_\w*?tst_(\d+)x(\d+)",
    r"MT(\d+)x(\d+)x\d+",
    r"_t(\d+)x(\d+)x\d+",
    r"gemm\w*?_(\d+)x(\d+)_\d+x\d+_(?:tn|nt|nn|tt)",
    r"gemm_(\d+)x(\d+)_",
)]
# hipBLASLt/Tensile kernels (Cijk_..._MT<M>x<N>x<K>_...) are launched with
# hipExtModuleLaunchKernel, whose size is the global work size in work-items: their Kineto
# "grid" counts threads (MI300 BERT: Cijk MT16x16 grid [73728,1,1] with block [256,1,1] =
# 288 workgroups), while Triton kernels on the same device report blocks (attn_fwd grid
# [2,8,1]).
_GRID_IN_WORK_ITEMS = name_regex(r"^Cijk_")
SMALL_TILE = 16     # token-side tile <= 16: built for a handful of token rows
LARGE_TILE = 128    # token-side tile >= 128: built for many rows

# Causality of a fused attention kernel, parsed from its name (int8 per kernel).
CAUSAL_UNKNOWN, CAUSAL_NO, CAUSAL_YES, CAUSAL_LOCAL = -1, 0, 1, 2
_TRAITS_BLOCK_M = name_regex(r"Flash_fwd_kernel_traits<\s*\d+\s*,\s*(\d+)\s*,")


@dataclass(frozen=True)
class Signature:
    """One kernel family from the data file."""
    id: str
    pattern: str
    role: str
    phase: str
    strength: str
    label: str
    source: str
    seen: str = ""
    grid_rule: str = ""
    step_end: bool = False
    inference_only: bool = False
    causal_bool: int = -1       # position of Is_causal among the boolean template arguments (-1: none)
    local_bool: int = -1        # position of Is_local among them (-1: none) ...
    local_min_bools: int = 0    # ... read only when the name has at least this many booleans
    causal_pattern: str = ""    # regex: the name spells a causal mask (e.g. "causal" in aiter kernel names)
    seqs_axis: str = ""         # "y": grid.y = sequences of an unsplit launch
    runs_empty: bool = False    # launched over every sequence, exits for the ones it does not serve


@dataclass
class KernelClasses:
    """Per-kernel classification, every array aligned with ``trace.kernels``.

    ``sig``: index into ``signatures`` (-1 = none); ``role``/``hint``/``strength``/``grid_rule``:
    the codes above; ``tile_min``: min(tile M, tile N) parsed from GEMM names (-1 unknown);
    ``tile_out``/``tile_tok``: the two tile sides of a GEMM name (-1 unknown): the first
    covers the output features (cuBLAS M of PyTorch's transposed call), the second the
    token rows; ``step_end``: sampling-type kernel that closes a step; ``inference_only``: a
    kernel only serving engines launch; ``causal``: CAUSAL_* code of an attention kernel
    (from its template arguments or name); ``block_m``: query rows per block of a
    FlashAttention kernel (kBlockM of its Flash_fwd_kernel_traits, -1 unknown).
    """
    signatures: list[Signature]
    sig: np.ndarray
    role: np.ndarray
    hint: np.ndarray
    strength: np.ndarray
    grid_rule: np.ndarray
    tile_min: np.ndarray
    step_end: np.ndarray
    inference_only: np.ndarray
    tile_out: np.ndarray
    tile_tok: np.ndarray
    causal: np.ndarray
    block_m: np.ndarray
    grid_in_work_items: np.ndarray
    rows_per_block: np.ndarray


def template_bools(name: str) -> list[bool]:
    """The boolean template arguments (``true``/``false``) at the top level of the first
    template argument list of a demangled kernel name, in order (nested lists skipped)."""
    i = name.find("<")
    if i < 0:
        return []
    depth, start, out = 0, i + 1, []
    for j in range(i, len(name)):
        ch = name[j]
        if ch == "<":
            depth += 1
            if depth == 1:
                start = j + 1
        elif ch in ",>":
            if depth == 1:
                arg = name[start:j].strip()
                if arg in ("true", "false"):
                    out.append(arg == "true")
                start = j + 1
            if ch == ">":
                depth -= 1
                if depth == 0:
                    break
    return out


def parse_causal(name: str, sig: Signature) -> int:
    """CAUSAL_* code of a kernel of signature ``sig`` from its name."""
    if sig.causal_pattern and name_regex(sig.causal_pattern).search(name):
        return CAUSAL_YES
    if sig.causal_bool < 0:
        return CAUSAL_UNKNOWN
    bools = template_bools(name)
    if len(bools) <= sig.causal_bool:
        return CAUSAL_UNKNOWN
    if bools[sig.causal_bool]:
        return CAUSAL_YES
    if 0 <= sig.local_bool < len(bools) and len(bools) >= sig.local_min_bools and bools[sig.local_bool]:
        return CAUSAL_LOCAL        # sliding window: decoders use it (window right = 0), so not "non-causal"
    return CAUSAL_NO


def parse_tile(name: str) -> tuple[int, int] | None:
    """(M, N) tile from a GEMM kernel name, or None when the name spells none."""
    for rx in _TILE_PATTERNS:
        m = rx.search(name)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def load_signatures(path: str | Path | None = None) -> list[Signature]:
    """Read and validate the signature table (raises InputError naming the file and entry)."""
    p = Path(path) if path is not None else DATA_FILE
    try:
        with open(p, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"{p}: cannot read kernel signatures: {e}") from None
    out: list[Signature] = []
    seen_ids: set[str] = set()
    for i, entry in enumerate(doc.get("signature", [])):
        where = f"{p}: signature #{i + 1} ({entry.get('id', '?')})"
        for key in ("id", "pattern", "role", "phase", "strength", "label", "source"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise InputError(f"{where}: missing or empty '{key}'")
        if entry["role"] not in ROLE_CODES:
            raise InputError(f"{where}: unknown role {entry['role']!r}")
        if entry["phase"] not in HINT_CODES:
            raise InputError(f"{where}: unknown phase {entry['phase']!r}")
        if entry["strength"] not in STRENGTH_CODES:
            raise InputError(f"{where}: unknown strength {entry['strength']!r}")
        if entry.get("grid_rule", "") not in GRID_CODES:
            raise InputError(f"{where}: unknown grid_rule {entry['grid_rule']!r}")
        if entry["id"] in seen_ids:
            raise InputError(f"{where}: duplicate id")
        for key in ("pattern", "causal_pattern"):
            try:
                name_regex(entry.get(key, ""))
            except re2.error as e:
                # e.g. a look-behind: RE2 runs in linear time by refusing what needs backtracking
                raise InputError(f"{where}: bad {key} (RE2 syntax, no look-around or back-references): "
                                 f"{e}") from None
        if entry.get("seqs_axis", "") not in ("", "y"):
            raise InputError(f"{where}: unknown seqs_axis {entry['seqs_axis']!r}")
        for key in ("causal_bool", "local_bool", "local_min_bools"):
            if not isinstance(entry.get(key, -1), int):
                raise InputError(f"{where}: '{key}' must be an integer")
        seen_ids.add(entry["id"])
        out.append(Signature(id=entry["id"], pattern=entry["pattern"], role=entry["role"], phase=entry["phase"],
                             strength=entry["strength"], label=entry["label"], source=entry["source"],
                             seen=entry.get("seen", ""), grid_rule=entry.get("grid_rule", ""),
                             step_end=bool(entry.get("step_end", False)),
                             inference_only=bool(entry.get("inference_only", False)),
                             causal_bool=int(entry.get("causal_bool", -1)), local_bool=int(entry.get("local_bool", -1)),
                             local_min_bools=int(entry.get("local_min_bools", 0)),
                             causal_pattern=entry.get("causal_pattern", ""), seqs_axis=entry.get("seqs_axis", ""),
                             runs_empty=bool(entry.get("runs_empty", False))))
    if not out:
        raise InputError(f"{p}: no [[signature]] entries")
    return out


@lru_cache(maxsize=4)
def _signatures_of(path: str, mtime_ns: int, size: int) -> tuple[Signature, ...]:
    return tuple(load_signatures(path))


def _default_signatures() -> tuple[Signature, ...]:
    """The built-in table, parsed once per process while the file's modification time
    and size stay the same (the agent classifies kernels every window)."""
    try:
        st = DATA_FILE.stat()
    except OSError:
        return tuple(load_signatures())      # raises the InputError naming the file
    return _signatures_of(str(DATA_FILE), st.st_mtime_ns, st.st_size)


def match_name_ids(names: NameTable, name_ids: np.ndarray, signatures: list[Signature]) -> np.ndarray:
    """Signature index for each id in ``name_ids`` (first match wins; -1 none).

    Matching runs over a sub-table of just these names, so the cost is one regex search per
    distinct kernel name and signature, independent of the number of kernel events.
    """
    name_ids = np.asarray(name_ids, dtype=np.int64)
    sub = NameTable(names[int(i)] if i >= 0 else "" for i in name_ids)
    # NameTable interns: equal strings share a slot; map back through positions.
    pos = np.array([sub.lookup(names[int(i)] if i >= 0 else "") for i in name_ids], dtype=np.int64)
    sub_sig = np.full(len(sub), -1, dtype=np.int32)
    for k, s in enumerate(signatures):
        hit = sub.ids_matching(name_regex(s.pattern))
        free = hit[sub_sig[hit] < 0]
        sub_sig[free] = k
    return sub_sig[pos] if len(pos) else np.empty(0, dtype=np.int32)


def _classify_ids(names: NameTable, uniq: np.ndarray, sigs: list[Signature]) -> dict[str, np.ndarray]:
    """Per-name classes of the distinct name ids ``uniq`` (-1: no name): signature index,
    GEMM tile sides, grid-in-work-items, causality, query block and softmax rows per block.
    One regex search per name and signature; nothing here depends on the kernels."""
    uniq_sig = match_name_ids(names, uniq, sigs)
    grid_of = np.array([GRID_CODES[s.grid_rule] for s in sigs] + [GRID_NONE], dtype=np.uint8)
    # Tiles: parsed once per distinct GEMM name.
    uniq_tile = np.full((len(uniq), 2), -1, dtype=np.int32)
    uniq_wi = np.zeros(len(uniq), dtype=bool)
    for j in np.flatnonzero((uniq_sig >= 0) & (grid_of[uniq_sig] == GRID_TILE)):
        t = parse_tile(names[int(uniq[j])])
        if t is not None:
            uniq_tile[j] = t
        uniq_wi[j] = bool(_GRID_IN_WORK_ITEMS.search(names[int(uniq[j])]))
    # Causality and query block of attention kernels: once per distinct name.
    uniq_causal = np.full(len(uniq), CAUSAL_UNKNOWN, dtype=np.int8)
    uniq_block_m = np.full(len(uniq), -1, dtype=np.int32)
    att = np.array([s.role in ("attention", "attention_aux") for s in sigs] + [False], dtype=bool)
    for j in np.flatnonzero((uniq_sig >= 0) & att[np.where(uniq_sig >= 0, uniq_sig, len(sigs))]):
        name = names[int(uniq[j])]
        uniq_causal[j] = parse_causal(name, sigs[int(uniq_sig[j])])
        m = _TRAITS_BLOCK_M.search(name)
        if m:
            uniq_block_m[j] = int(m.group(1))
    # Softmax rows per block: cunn_SoftMaxForward one block per row; softmax_warp_forward
    # (aten/src/ATen/native/cuda/PersistentSoftmax.cuh dispatch_softmax_forward): warp size
    # min(2^log2, 32), 2 rows per warp up to 128 elements, 128 threads per block.
    uniq_rpb = np.full(len(uniq), -1, dtype=np.int32)
    for j in np.flatnonzero((uniq_sig >= 0) & np.isin(grid_of[np.where(uniq_sig >= 0, uniq_sig, len(sigs))],
                                                      (GRID_ROWS, GRID_WARP_ROWS))):
        if grid_of[uniq_sig[j]] == GRID_ROWS:
            uniq_rpb[j] = 1
            continue
        m = _SOFTMAX_LOG2.search(names[int(uniq[j])])
        if m:
            elements = 1 << int(m.group(1))
            warp = min(elements, 32)
            uniq_rpb[j] = (128 // warp) * (2 if elements <= 128 else 1)
    return {"sig": uniq_sig.astype(np.int32), "tile_out": uniq_tile[:, 0].copy(), "tile_tok": uniq_tile[:, 1].copy(),
            "grid_in_work_items": uniq_wi, "causal": uniq_causal, "block_m": uniq_block_m, "rows_per_block": uniq_rpb}


#: The per-name class columns :func:`_classify_ids` returns, with what a name that is not
#: matched at all holds (:func:`unclassified_rows`).
_UNCLASSIFIED = (("sig", np.int32, -1), ("tile_out", np.int32, -1), ("tile_tok", np.int32, -1),
                 ("grid_in_work_items", bool, False), ("causal", np.int8, CAUSAL_UNKNOWN),
                 ("block_m", np.int32, -1), ("rows_per_block", np.int32, -1))


def classify_names(strings: list[str]) -> dict[str, np.ndarray]:
    """Per-name classes of ``strings`` under the built-in signatures (one row per string),
    for :func:`store_name_classes`. Touches no shared table: a thread that receives names
    (the CUPTI probe's pump) classifies them here, when they are interned, so that the
    agent's main loop matches no name (issue 18.1)."""
    sub = NameTable()
    ids = np.fromiter((sub.intern(s) for s in strings), np.int32, len(strings))
    return _classify_ids(sub, ids, list(_default_signatures()))


def unclassified_rows(n: int) -> dict[str, np.ndarray]:
    """Rows of ``n`` names left unmatched (what a name no signature matches gets)."""
    return {f: np.full(n, v, dtype=dt) for f, dt, v in _UNCLASSIFIED}


def take_rows(rows: dict[str, np.ndarray], index) -> dict[str, np.ndarray]:
    """The rows at ``index`` of a :func:`classify_names` answer."""
    return {f: a[index] for f, a in rows.items()}


def store_name_classes(names: NameTable, ids: np.ndarray, rows: dict[str, np.ndarray],
                       provisional: np.ndarray | None = None) -> None:
    """Record classes computed elsewhere (:func:`classify_names`) for name ids ``ids`` of
    ``names``, so that :func:`classify_kernels` with the built-in signatures matches none
    of them again. ``provisional``: per id, True for rows that stand in for a match not
    made (a peer's time budget spent, :func:`unclassified_rows`); a later real row for the
    same name replaces them (one user's budget must not leave another's names unmatched)
    and bumps :attr:`_NameClasses.generation`, so caches of the classes refresh."""
    default = _default_signatures()
    memo = _NAME_CLASSES.get(names)
    if memo is None or memo.sigs_key is not default:
        memo = _NAME_CLASSES[names] = _NameClasses(default)
    ids = np.asarray(ids, dtype=np.int64)
    memo.store(len(names), ids + 1, rows, np.zeros(len(ids), bool) if provisional is None else provisional)


def name_classes_generation(names: NameTable) -> int:
    """How many times stored classes of ``names`` were replaced (see :func:`store_name_classes`)."""
    try:
        memo = _NAME_CLASSES.get(names)
    except TypeError:           # a name table that cannot be weakly referenced: never stored into
        return 0
    return memo.generation if memo is not None else 0


class PeerNameClassifier:
    """What the CUPTI probe's pump thread matches names with (the probe's
    ``NameClassifier``; the probes layer cannot import this one): :func:`classify_names`,
    :func:`unclassified_rows` and :func:`store_name_classes`."""

    @staticmethod
    def classify(strings: list[str]) -> dict[str, np.ndarray]:
        return classify_names(strings)

    @staticmethod
    def unclassified(n: int) -> dict[str, np.ndarray]:
        return unclassified_rows(n)

    @staticmethod
    def store(names: NameTable, ids: np.ndarray, rows: dict[str, np.ndarray], provisional: np.ndarray) -> None:
        store_name_classes(names, ids, rows, provisional)


class _NameClasses:
    """The per-name classes of one append-only :class:`NameTable` under one signature
    list, filled as names are first seen: a name is matched once for the life of the
    table, whichever trace or batch it comes in (the live agent's phase mapper classifies
    one step's kernels per new step shape; re-matching the names each time was most of
    its cost). Slot 0 is "no name" (id -1), slot i + 1 the name of id i.

    Filled by :meth:`update` (matching here) or :meth:`store` (rows matched by another
    thread); a lock keeps the two apart, and matching in :meth:`update` is done outside
    it."""

    def __init__(self, sigs_key):
        self.sigs_key = sigs_key
        self.done = np.zeros(1, dtype=bool)
        self.provisional = np.zeros(1, dtype=bool)
        self.generation = 0
        self._lock = threading.Lock()
        # slot 0, "no name", matches nothing: filled here, so no caller matches it
        self.arrays: dict[str, np.ndarray] = unclassified_rows(1)
        self.done[0] = True

    def _grow(self, size: int) -> None:
        if len(self.done) >= size:
            return
        cap = max(2 * size, 64)          # doubling: a table growing one name at a time copies O(n) in all
        for attr in ("done", "provisional"):
            a = np.zeros(cap, dtype=bool)
            old = getattr(self, attr)
            a[:len(old)] = old
            setattr(self, attr, a)
        for f, a in self.arrays.items():
            g = np.empty(cap, dtype=a.dtype)
            g[:len(a)] = a
            self.arrays[f] = g

    def _put(self, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        for f, a in rows.items():
            if f not in self.arrays:
                self.arrays[f] = np.empty(len(self.done), dtype=a.dtype)
            self.arrays[f][slots] = a

    def store(self, size: int, slots: np.ndarray, rows: dict[str, np.ndarray], provisional: np.ndarray) -> None:
        with self._lock:
            self._grow(size + 1)
            replace = self.done[slots] & self.provisional[slots] & ~provisional
            put = ~self.done[slots] | replace
            if not put.any():
                return
            self._put(slots[put], take_rows(rows, put))
            self.done[slots[put]] = True
            self.provisional[slots[put]] = provisional[put]
            if replace.any():
                self.generation += 1

    def update(self, names: NameTable, slots: np.ndarray, sigs: list[Signature]) -> None:
        """Classify the slots not classified yet (matching outside the lock)."""
        with self._lock:
            self._grow(len(names) + 1)
            new = slots[~self.done[slots]]
        if not len(new):
            return
        got = _classify_ids(names, (new - 1).astype(np.int32), sigs)
        with self._lock:
            self._grow(len(names) + 1)
            self._put(new, got)
            self.done[new] = True


_NAME_CLASSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def classify_kernels(trace: Trace, signatures: list[Signature] | None = None) -> KernelClasses:
    """Classify every kernel of ``trace`` by its name (vectorised over kernels).

    With the built-in signatures, each name of the trace's (append-only) name table is
    matched once per process (:class:`_NameClasses`, kept as long as the table lives);
    an explicit ``signatures`` list is matched afresh."""
    default = _default_signatures()
    sigs = list(signatures) if signatures is not None else list(default)
    k = trace.kernels
    n = len(k)
    names = trace.names
    # Distinct name ids through a table over the name table (linear; no sort of the kernels).
    shifted = k["name_id"].astype(np.int64) + 1             # -1 (no name) -> slot 0
    present = np.zeros(len(names) + 1, dtype=bool)
    present[shifted] = True
    slots = np.flatnonzero(present)
    memo = None
    if signatures is None:
        try:
            memo = _NAME_CLASSES.get(names)
            if memo is None or memo.sigs_key is not default:
                memo = _NAME_CLASSES[names] = _NameClasses(default)
        except TypeError:               # a name table that cannot be weakly referenced: no memo
            memo = None
    if memo is not None:
        memo.update(names, slots, sigs)
        per, inverse = memo.arrays, shifted
    else:
        slot_pos = np.zeros(len(present), dtype=np.int64)
        slot_pos[slots] = np.arange(len(slots))
        inverse = slot_pos[shifted]
        per = _classify_ids(names, (slots - 1).astype(np.int32), sigs)
    role_of = np.array([ROLE_CODES[s.role] for s in sigs] + [ROLE_NONE], dtype=np.uint8)
    hint_of = np.array([HINT_CODES[s.phase] for s in sigs] + [HINT_NEUTRAL], dtype=np.uint8)
    strength_of = np.array([STRENGTH_CODES[s.strength] for s in sigs] + [0], dtype=np.uint8)
    grid_of = np.array([GRID_CODES[s.grid_rule] for s in sigs] + [GRID_NONE], dtype=np.uint8)
    end_of = np.array([s.step_end for s in sigs] + [False], dtype=bool)
    inf_of = np.array([s.inference_only for s in sigs] + [False], dtype=bool)
    if not n:
        inverse = inverse[:0]
    sig = per["sig"][inverse] if len(slots) else np.empty(0, dtype=np.int32)
    look = np.where(sig >= 0, sig, len(sigs))
    tile_out = per["tile_out"][inverse] if len(slots) else np.empty(0, dtype=np.int32)
    tile_tok = per["tile_tok"][inverse] if len(slots) else np.empty(0, dtype=np.int32)
    tmin = np.minimum(tile_out, tile_tok)
    tile_min = np.where(tmin > 0, tmin, -1).astype(np.int32)

    def col(f, dt):
        return per[f][inverse] if len(slots) else np.empty(0, dtype=dt)
    return KernelClasses(signatures=sigs, sig=sig.astype(np.int32), role=role_of[look], hint=hint_of[look],
                         strength=strength_of[look], grid_rule=grid_of[look], tile_min=tile_min,
                         step_end=end_of[look], inference_only=inf_of[look],
                         tile_out=tile_out, tile_tok=tile_tok,
                         causal=col("causal", np.int8), block_m=col("block_m", np.int32),
                         grid_in_work_items=col("grid_in_work_items", bool),
                         rows_per_block=col("rows_per_block", np.int32))


_TEMPLATE_NAME = name_regex(r"<\s*(?:void\s+)?([\w:]+)")


@lru_cache(maxsize=4096)
def short_name(name: str, limit: int = 60) -> str:
    """Readable kernel name for evidence strings: return type, templates and arguments dropped."""
    base = name.replace("(anonymous namespace)::", "")
    if ">::type " in base:          # std::enable_if<...>::type ns::kernel<...>(...)
        base = base.split(">::type ", 1)[1]
    if base.startswith("void "):
        base = base[5:]
    cut = len(base)
    for ch in "<(":
        i = base.find(ch)
        if i > 0:
            cut = min(cut, i)
    parts = base[:cut].strip().split("::")
    last = parts[-1]
    if last in ("Kernel", "Kernel2", "device_kernel") and cut < len(base) and base[cut] == "<":
        # cutlass::Kernel2<cutlass_80_..._gemm_...>: the template argument is the real name.
        m = _TEMPLATE_NAME.match(base[cut:])
        if m:
            last = m.group(1).split("::")[-1]
    elif last in ("kernel",) and len(parts) > 1:
        last = f"{parts[-2]}::{last}"
    return (last or name)[:limit]

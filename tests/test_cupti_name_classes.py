"""Kernel names from injected processes are matched against the signatures once, when
interned, on the CUPTI probe's pump thread, within a CPU budget per process and per user
(issue 18.1); the phase mapper on the agent's main loop then matches none.

Before: the probe handed names on unmatched and ``StreamPhaser.classes`` matched every new
name on the main loop (holding the GIL), with no bound per peer; each test below fails on
that code (no classifier, no budget, no stand-in replacement).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from support import cupti_records as R

from ridgeline.aggregator import signatures as S
from ridgeline.aggregator.signatures import PeerNameClassifier, classify_kernels
from ridgeline.aggregator.stream_phases import StreamPhaser
from ridgeline.probes.cupti import probe as probe_mod
from ridgeline.probes.cupti import protocol as P
from ridgeline.probes.cupti.peer_time_budget import PeerTimeBudget
from ridgeline.probes.cupti.probe import CuptiProbe
from ridgeline.probes.cupti.server import Message
from ridgeline.probes.events import KERNEL_DTYPE, NameTable, Trace, empty

HDR = P.FRAME_DTYPE.itemsize
FMHA = "fmha_v2_flash_attention_fp16_64_128_S_32_sm80_kernel"     # a built-in signature matches it


def _hello(pid, uid, conn):
    return Message("hello", conn, pid, P.parse_hello(memoryview(R.hello_frame(pid=pid))[HDR:]), 0, uid)


def _batch(pid, conn, tag):
    """A batch of kernels whose names are FMHA variants ending in ``tag`` and an index;
    returns the message and the names (kernels, so that collect() hands the names on)."""
    b = R.make_buffer(8, seed=3, with_markers=False)
    names = {k: f"{FMHA}{tag}{i}" for i, k in enumerate(b.names)}
    frame = R.batch_frame([(10, R.KERNEL.itemsize, b.kernels.tobytes())], names, pid=pid)
    return Message("batch", conn, pid, P.parse_batch(memoryview(frame)[HDR:]), 0), list(names.values())


class _Matches:
    """Counts the names matched, per thread (wraps aggregator.signatures._classify_ids)."""

    def __init__(self, monkeypatch):
        self.by_thread: dict[str, int] = {}
        real = S._classify_ids

        def counted(names, uniq, sigs):
            t = threading.current_thread().name
            self.by_thread[t] = self.by_thread.get(t, 0) + len(uniq)
            return real(names, uniq, sigs)
        monkeypatch.setattr(S, "_classify_ids", counted)


def _probe(classifier=True, burst_s=100.0):
    p = CuptiProbe("/nonexistent/c.sock", name_classifier=PeerNameClassifier() if classifier else None)
    p.classify_budget = PeerTimeBudget(burst_s, 0.0, burst_s, 0.0)
    return p


def _sig_of(names: NameTable, name: str) -> int:
    return int(StreamPhaser(names).classes(np.array([names.lookup(name)])).sig[0])


def _ingest_on_a_thread(p, msgs):
    t = threading.Thread(target=p.ingest, args=(msgs,), name="pump")
    t.start()
    t.join()


def test_the_main_loop_matches_no_name_of_a_process(monkeypatch):
    m = _Matches(monkeypatch)
    p = _probe()
    batch, names = _batch(4242, 1, "_")
    _ingest_on_a_thread(p, [_hello(4242, 1000, 1), batch])
    p.collect()                                   # the names move to the probe-wide table (main loop)
    main = threading.current_thread().name
    before = m.by_thread.get(main, 0)
    ph = StreamPhaser(p.names)
    ids = np.array([p.names.lookup(s) for s in names])
    assert (ids >= 0).all()
    kc = ph.classes(ids)
    assert m.by_thread.get(main, 0) == before == 0          # nothing matched here
    assert m.by_thread["pump"] >= len(names)                # all of them there
    fmha = [k for k, s in enumerate(kc.signatures) if S.name_regex(s.pattern).search(FMHA)][0]
    assert (kc.sig == fmha).all()                           # and the classes are the real ones


def test_without_a_classifier_the_main_loop_still_matches(monkeypatch):
    """The control: the same process without the pump-thread classifier (the old path)."""
    m = _Matches(monkeypatch)
    p = _probe(classifier=False)
    batch, names = _batch(4243, 1, "_")
    _ingest_on_a_thread(p, [_hello(4243, 1000, 1), batch])
    p.collect()
    StreamPhaser(p.names).classes(np.array([p.names.lookup(names[0])]))
    assert m.by_thread.get(threading.current_thread().name, 0) > 0


def test_a_process_past_its_budget_gets_unmatched_names_counted_and_others_do_not(monkeypatch):
    t = [0.0]

    def cpu():                     # read before and after each chunk: each costs 1 s of "CPU"
        t[0] += 1.0
        return t[0]
    monkeypatch.setattr(probe_mod, "thread_time", cpu)
    p = _probe(burst_s=3.0)
    p.ingest([_hello(500, 1000, 1)])          # its one API name: the first chunk (1 s)
    got = []
    for i in range(6):             # new names each batch: one chunk each, 1 s each
        batch, names = _batch(500, 1, f"_a{i}_")
        got.append(names)
        p.ingest([batch])
    c = p.counters()
    assert c["names_not_classified"] == 4 * len(got[0])     # 3 s spent after three chunks
    assert c["classify_budget_refused_calls"] == 4
    assert c["classify_seconds"] == pytest.approx(3.0)
    batch, other = _batch(600, 2, "_b")
    p.ingest([_hello(600, 2000, 2), batch])                 # another user: matched
    assert p.counters()["names_not_classified"] == 4 * len(got[0])
    p.collect()
    assert _sig_of(p.names, got[1][0]) >= 0 and _sig_of(p.names, other[0]) >= 0
    assert _sig_of(p.names, got[5][0]) == -1    # left unmatched, and not matched on the main loop


def test_a_spent_users_stand_in_does_not_stick_to_another_users_name(monkeypatch):
    """A user whose budget is spent sends a victim's kernel name first: the stand-in row is
    replaced by the victim's real one, and a phase mapper that already read it refreshes."""
    p = _probe()
    p.classify_budget = PeerTimeBudget(0.0, 0.0, 0.0, 0.0)      # everyone's budget spent ...
    batch, names = _batch(700, 1, "_v")
    p.ingest([_hello(700, 1000, 1), batch])
    p.collect()
    ph = StreamPhaser(p.names)
    nid = np.array([p.names.lookup(names[0])])
    assert int(ph.classes(nid).sig[0]) == -1
    p.classify_budget = PeerTimeBudget(100.0, 0.0, 100.0, 0.0)  # ... then the victim's is not
    p.ingest([_hello(800, 0, 2), _batch(800, 2, "_v")[0]])
    p.collect()
    assert int(ph.classes(nid).sig[0]) >= 0


def test_names_collected_before_the_pump_matched_them_get_real_rows_later(monkeypatch):
    """collect() on the main loop while the pump thread is matching a chunk: the names it
    moves get stand-ins (nothing matched on the main loop), replaced when the chunk ends."""
    m = _Matches(monkeypatch)
    p = _probe()
    entered, release = threading.Event(), threading.Event()
    real = PeerNameClassifier.classify

    def held(strings):
        entered.set()
        release.wait(30)
        return real(strings)
    p.name_classifier = PeerNameClassifier()
    monkeypatch.setattr(p.name_classifier, "classify", held)
    batch, names = _batch(900, 1, "_h")
    th = threading.Thread(target=p.ingest, args=([_hello(900, 1000, 1), batch],), name="pump")
    th.start()
    assert entered.wait(30)
    p.collect()                                   # the lock is let go while the chunk is matched
    ph = StreamPhaser(p.names)
    nid = np.array([p.names.lookup(names[0])])
    assert nid[0] >= 0
    assert int(ph.classes(nid).sig[0]) == -1      # a stand-in for now
    release.set()
    th.join(30)
    assert int(ph.classes(nid).sig[0]) >= 0
    assert m.by_thread.get(threading.current_thread().name, 0) == 0


def test_stored_rows_are_what_matching_gives():
    """store_name_classes + classify_kernels equal classify_kernels alone (every column),
    over the built-in signatures' own example names."""
    strings = [FMHA, "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >(int)",
               "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", "nothing_known", "ncclKernel_AllReduce"]
    a, b = NameTable(strings), NameTable(strings)
    S.store_name_classes(b, np.arange(len(strings)), S.classify_names(strings))
    k = empty(KERNEL_DTYPE, len(strings))
    k["name_id"] = np.arange(len(strings))
    ka, kb = classify_kernels(Trace(kernels=k, names=a)), classify_kernels(Trace(kernels=k.copy(), names=b))
    for f in ("sig", "role", "tile_out", "tile_tok", "causal", "block_m", "grid_in_work_items", "rows_per_block"):
        assert np.array_equal(getattr(ka, f), getattr(kb, f)), f

"""Log lines a peer can cause are rate-limited per kind and per peer, and counted (issue 18.5).
Before: every bad frame of every connection gave its line (4,578 lines/s)."""
import logging

from ridgeline.probes.log_limit import LogLimit


class _Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _run(lim, n, peer, msg="cupti: pid %d: %s; connection closed"):
    log = logging.getLogger("ridgeline.test.limit")
    shown = []
    for i in range(n):
        r = log.makeRecord(log.name, logging.WARNING, __file__, 1, msg, (i, "bad magic"), None, extra={"peer": peer})
        if lim.filter(r):
            shown.append(r.getMessage())
    return shown


def test_a_flood_from_one_peer_is_cut_and_counted_and_summarised():
    clock = _Clock()
    lim = LogLimit(burst=10, per_s=0.2, kind_burst=30, kind_per_s=1.0, clock=clock)
    assert len(_run(lim, 5000, peer=65534)) == 10
    assert lim.total_suppressed() == 4990
    clock.t += 5.0                                   # one more token after 5 s
    shown = _run(lim, 1, peer=65534)
    assert len(shown) == 1 and "4990 more lines of this kind suppressed" in shown[0]


def test_another_peer_still_gets_its_lines_and_many_peers_are_bounded_per_kind():
    clock = _Clock()
    lim = LogLimit(burst=10, per_s=0.2, kind_burst=30, kind_per_s=1.0, clock=clock)
    _run(lim, 1000, peer=65534)
    assert len(_run(lim, 5, peer=0)) == 5            # root's lines of the same kind
    total = sum(len(_run(lim, 100, peer=uid)) for uid in range(1000, 1100))
    assert total <= 30                                # the kind's own bucket
    assert len(_run(lim, 3, peer=0, msg="cupti: another kind %d %s")) == 3

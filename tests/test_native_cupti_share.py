"""torch.profiler inside an injected process on a legacy CUPTI, replayed call for call from
libkineto's source (probes/native/tests/kineto_replay.c: pytorch/kineto libkineto/src at
0f9bef9a, the functions cited unchanged 2026-02-02..2026-03-24, around torch 2.11's branch
cut; the exact pin could not be read here):

- GenericActivityProfiler.cpp:477-478, 534 configure -> CuptiActivityProfiler.cpp:120-123
  cuptiActivityRegisterTimestampCallback(getApproximateTime = __rdtsc, ApproximateClock.h:77-79,
  on by default, Config.h:527), CuptiActivityApi.cpp:318 cuptiActivityRegisterCallbacks,
  :324-358 cuptiActivityEnable of its kinds;
- GenericActivityProfiler.cpp:624 stop -> CuptiActivityApi.cpp:371-398 cuptiActivityDisable;
- CuptiActivityProfiler.cpp:184 -> CuptiActivityApi.cpp:166-181 activityBuffers: nothing
  unless one of its buffers is outstanding, else cuptiActivityFlushAll(FORCED);
- CuptiActivityApi.cpp:266-272 bufferCompleted drops a buffer it did not allocate.

Issue 17 items 1 and 2: with the library preloaded (`ridgeline run`), no record of either
side is lost, and timestamps after the profiler's TSC source stay CLOCK_REALTIME ns.
"""
from __future__ import annotations

from support.cupti_stub import LIB, NATIVE, TESTLIB, StubApp, built  # noqa: F401  (the build fixture)
from support.cupti_stub import Agent as TakeoverAgent

from ridgeline.probes.cupti import protocol as P

REPLAY = NATIVE / "build" / "libkineto_replay.so"
FLAG_TAKEN_OVER = getattr(P, "FLAG_TAKEN_OVER", 1 << 6)


class Agent(TakeoverAgent):
    """The agent's real server (support.cupti_stub.Agent), closed by the test."""


def _check_10ms_kernel(agent, corr, timed):
    """The 10 ms kernel stamped with the other client's ticks arrives as CLOCK_REALTIME ns,
    its duration within 5% of 10 ms of what really passed between its two timestamps (a
    loaded host stretches the stub's busy wait: the span the stub bracketed with
    CLOCK_REALTIME reads, lo..hi, is the truth)."""
    start, end = agent.kernels[corr]
    wall_ns, (lo, hi) = timed["wall_ns"], timed["span_ns"]
    assert abs(start - wall_ns) < 1_000_000_000, (start, wall_ns)      # CLOCK_REALTIME ns, not ticks
    assert lo >= 10_000_000
    assert lo - 500_000 < end - start < hi + 500_000, (end - start, lo, hi)   # within 5% of 10 ms


def test_preloaded_library_shares_cupti_with_kineto_and_loses_nothing(tmp_path):
    agent = Agent(tmp_path / "cupti.sock")
    app = StubApp(tmp_path / "cupti.sock", RIDGELINE_FLUSH_MS=100, LD_PRELOAD=str(TESTLIB),
                  STUB_KINETO_REPLAY=str(REPLAY))
    try:
        app("emit 5 0 100")
        agent.pump(30, until=lambda a: len(a.kernels) >= 5)
        app("hold 1")                       # work in flight: our current buffer stays inside CUPTI
        app("emit 3 0 200")
        assert app("k_configure 1")["rc"] == 0
        app("hold 0")
        app("emit 4 0 300")                 # during the session
        app("k_stop")
        k = app("k_process")                # its forced flush: its share is in its hands
        app("k_reset")
        stats = app("k_stats")
        app("emit 3 0 500")                 # after it
        timed = app("emit_timed 1 10000 900")
        want = set(range(100, 105)) | {200, 201, 202} | set(range(300, 304)) | {500, 501, 502, 900}
        agent.pump(30, until=lambda a: want <= set(a.kernels))
        c = app("counters")
        log = app("log")["log"]
    finally:
        err = app.close()
        agent.srv.close()
    assert stats["unknown"] == 0 and "unknown buffer" not in err        # Kineto dropped nothing
    kineto = {kc for kc, _, _ in k["kernels"]}
    assert set(range(300, 304)) <= kineto and {200, 201, 202} <= kineto  # every kernel of its session
    assert want == set(agent.kernels)                                     # and every one of ours
    assert not any(h.flags & P.FLAG_TAKEN_OVER for h in agent.hellos) and c["takeovers"] == 0
    assert c["guest_sessions"] == 1 and c["guest_records"] >= 7
    # CUPTI kept Ridgeline's callbacks: Kineto's registration never reached it
    assert log.count("register") == 1
    # Kineto's timestamp source (__rdtsc) is in force after its session: still ns at the agent
    _check_10ms_kernel(agent, 900, timed)
    status = agent.hellos[-1].status
    assert "clock: another CUPTI client registered its timestamp source (ticks" in status


def test_without_preload_the_ticks_after_a_profile_are_mapped_to_realtime(tmp_path):
    # the library only injected (no LD_PRELOAD): Kineto takes CUPTI over; after the operator's
    # reclaim its TSC source stays in force (no teardown), and CUPTI's timestamps are ticks.
    agent = Agent(tmp_path / "cupti.sock")
    app = StubApp(tmp_path / "cupti.sock", RIDGELINE_FLUSH_MS=100, STUB_KINETO_REPLAY=str(REPLAY))
    try:
        app("emit 2 0 100")
        agent.pump(30, until=lambda a: len(a.kernels) >= 2)
        assert app("k_configure 1")["rc"] == 0
        agent.pump(30, until=Agent.taken_over)      # the source change announces the takeover
        assert agent.taken_over()
        app("k_stop")
        app("k_process")
        agent.reclaim()
        agent.pump(30, until=lambda a: not a.taken_over())
        timed = app("emit_timed 1 10000 900")
        agent.pump(30, until=lambda a: 900 in a.kernels)
        c = app("counters")
    finally:
        app.close()
        agent.srv.close()
    _check_10ms_kernel(agent, 900, timed)
    assert c["clock_mapped"] >= 1 and c["clock_pairs"] >= 2


def test_ridgeline_run_preloads_the_library_before_what_was_preloaded():
    from ridgeline.probes.cupti.library import injection_env
    env = injection_env("/tmp/s.sock", libcupti=None, lib=LIB, inherited_preload="/opt/a.so /opt/b.so")
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/a.so:/opt/b.so" and env["CUDA_INJECTION64_PATH"] == str(LIB)
    assert "LD_PRELOAD" not in injection_env("/tmp/s.sock", libcupti=None, lib=LIB, preload=False)

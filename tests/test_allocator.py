"""agent/allocator.py: glibc keeps the folds' freed memory for the next fold, and a spike's
leftover is given back (SpikeTrim's decisions from RSS literals; the trim itself in a child
process that allocates and frees like a backlog fold)."""
import subprocess
import sys
import textwrap

from ridgeline.agent.allocator import SpikeTrim

MiB = 1 << 20


def feed(policy, rss_mib):
    return [policy.observe(r * MiB) for r in rss_mib]


def test_a_steady_agent_is_trimmed_after_start_up_and_then_only_now_and_then():
    p = SpikeTrim(spike_bytes=32 * MiB, settle_windows=4, min_trim_windows=20, period_windows=120)
    got = feed(p, [60, 120, 125, 125] + [80, 75, 75, 75] + [75, 76, 74, 80, 90, 100] * 50)
    # what start-up's folds left is given back at window 4, the level read 4 windows on;
    # nothing over it by 32 MiB, so only the periodic trims follow (windows 124, 244)
    assert [i + 1 for i, t in enumerate(got) if t] == [4, 124, 244]
    assert p.trims == 3 and p.steady_bytes == 74 * MiB


def test_a_level_read_during_a_spike_stands_only_until_the_next_periodic_trim():
    p = SpikeTrim(spike_bytes=32 * MiB, settle_windows=4, min_trim_windows=20, period_windows=120)
    got = feed(p, [60, 70, 75, 75, 140, 140, 140, 140] + [140] * 120 + [75] * 10)
    assert [i + 1 for i, t in enumerate(got) if t] == [4, 124]
    assert p.steady_bytes == 75 * MiB


def test_a_spike_is_trimmed_once_and_the_level_read_again_after_it():
    p = SpikeTrim(spike_bytes=32 * MiB, settle_windows=4, min_trim_windows=20)
    got = feed(p, [60] * 8 + [75] * 14 + [160, 160, 90, 80, 78, 77, 77, 160])
    # window 23: 160 > 60 + 32, 19 windows after the start-up trim (window 4): not yet;
    # window 24 trims; four windows settle (the last read is the level, 77); the spike at
    # window 30 waits for min_trim_windows
    assert got.index(True, 4) == 23 and got.count(True) == 2
    assert p.trims == 2 and p.steady_bytes == 77 * MiB
    got = feed(p, [160] * 14)        # window 44: 20 after the trim at window 24
    assert got == [False] * 13 + [True] and p.trims == 3


def test_a_working_set_that_grew_is_the_new_level_after_one_trim():
    p = SpikeTrim(spike_bytes=32 * MiB, settle_windows=4, min_trim_windows=20)
    got = feed(p, [75] * 24 + [200] * 100)
    assert got.count(True) == 2      # start-up's, then the growth's
    assert p.steady_bytes == 200 * MiB


def test_the_trim_gives_a_backlog_folds_freed_memory_back():
    # The agent's allocator settings, then temporaries of a backlog fold (tens of 1-4 MB
    # arrays, under the 32 MiB mmap threshold, so from the heap): freed, they stay resident
    # until the trim.
    code = textwrap.dedent("""
        import numpy as np
        from ridgeline.agent.allocator import keep_freed_memory
        from ridgeline.agent.health import rss_bytes
        from ridgeline.probes.heap_trim import trim_heap
        assert keep_freed_memory()
        base = rss_bytes()
        parts = [np.ones(n, np.uint8) for n in [3 << 20, 1 << 20, 4 << 20, 2 << 20] * 10]
        keep = np.ones(1 << 16, np.uint8)     # a live block above the freed ones
        del parts
        freed = rss_bytes()
        assert trim_heap()
        trimmed = rss_bytes()
        print((freed - base) >> 20, (trimmed - base) >> 20)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kept, after = map(int, out.stdout.split())
    assert kept >= 80            # 100 MiB freed and kept by the thresholds
    assert after <= 10           # given back

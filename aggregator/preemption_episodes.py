"""Preemption episodes and their recovery time, from consecutive engine windows (pure).

Definition (docs/engine-metrics.md, "Preemption episodes"):

* An **episode** starts at the first window whose preemption count (counter delta;
  SGLang: retracted requests) is above zero while no episode is open. Its start time is
  that window's end (the resolution is one window: the preemption happened in it).
* The **baseline** is the waiting queue of the window just before the episode (the last
  window without preemptions); with no earlier window, the waiting queue of the first
  window of the episode.
* The episode **recovers** at the end of the first later window in which KV usage is back
  under the watermark (``kv_usage_ratio < watermark``), the waiting queue is back at or
  under the baseline, and no preemption happened. **Recovery time** = recovery time stamp
  minus start time stamp, in seconds. Preemptions during the episode extend it.
* An episode still open has no recovery time (None), only its elapsed time; nothing is
  invented when KV usage or the queue length is unknown (the episode stays open).

:class:`PreemptionEpisodes` is fed one engine record per window with
:meth:`~PreemptionEpisodes.update` and returns the figures that go into that record.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KV_WATERMARK_RATIO = 0.85


@dataclass
class PreemptionEpisodes:
    watermark_ratio: float = KV_WATERMARK_RATIO
    episodes: int = 0                    # episodes started
    recovered: int = 0                   # episodes that recovered
    last_recovery_s: float | None = None
    recoveries_s: list = field(default_factory=list)   # the last 64 recovery times
    _open: dict | None = None
    _prev_waiting: float | None = None

    def update(self, rec: dict, ts_ns: int) -> dict:
        """Fold one window (an engine record: ``preemptions``, ``kv_usage_ratio``,
        ``num_waiting_requests``) ending at ``ts_ns``; returns this window's episode figures."""
        pre = rec.get("preemptions")
        if pre is None and rec.get("retracted_requests_last_tick"):
            pre = rec["retracted_requests_last_tick"]
        kv = rec.get("kv_usage_ratio")
        waiting = rec.get("num_waiting_requests")
        recovered_now = None
        if self._open is None:
            if pre:
                base = self._prev_waiting if self._prev_waiting is not None else waiting
                self._open = {"start_ns": ts_ns, "baseline_waiting": base, "preemptions": float(pre)}
                self.episodes += 1
        else:
            ep = self._open
            if pre:
                ep["preemptions"] += float(pre)
            elif (kv is not None and kv < self.watermark_ratio and waiting is not None
                  and (ep["baseline_waiting"] is None or waiting <= ep["baseline_waiting"])):
                recovered_now = (ts_ns - ep["start_ns"]) / 1e9
                self.last_recovery_s = recovered_now
                self.recoveries_s = (self.recoveries_s + [recovered_now])[-64:]
                self.recovered += 1
                self._open = None
        if not pre and self._open is None:
            self._prev_waiting = waiting
        ep = self._open
        return {
            "preemption_episode_active": ep is not None,
            "preemption_episode_elapsed_s": (ts_ns - ep["start_ns"]) / 1e9 if ep else None,
            "preemption_episode_preemptions": ep["preemptions"] if ep else None,
            "preemption_episode_baseline_waiting": ep["baseline_waiting"] if ep else None,
            "preemption_episodes_total": self.episodes,
            "preemption_episodes_recovered_total": self.recovered,
            "preemption_recovery_s": recovered_now,
            "preemption_last_recovery_s": self.last_recovery_s,
        }

"""Request arrivals and lengths, drawn ahead of time from one seeded generator.

Arrivals are Poisson at ``rate_per_s`` or follow a recorded rate (a list of
``(duration_s, rate_per_s)`` segments, Poisson within each); prompt and output lengths
are log-normal around their means, clipped to ``[1, max]``. ``shared_prefix_tokens``
makes every prompt start with the same system prompt (for prefix-cache hits).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ridgeline.probes.errors import InputError


@dataclass(frozen=True)
class Workload:
    rate_per_s: float = 4.0
    duration_s: float = 60.0
    prompt_mean: int = 512
    prompt_max: int = 4096
    output_mean: int = 256
    output_max: int = 1024
    length_sigma: float = 0.5
    shared_prefix_tokens: int = 0
    recorded_rate: tuple = field(default_factory=tuple)   # ((duration_s, rate_per_s), ...)

    def validate(self) -> None:
        if self.rate_per_s <= 0 and not self.recorded_rate:
            raise InputError("arrival rate must be > 0")
        if self.duration_s <= 0:
            raise InputError("duration must be > 0")
        if min(self.prompt_mean, self.output_mean, self.prompt_max, self.output_max) < 1:
            raise InputError("prompt/output lengths must be >= 1")
        if self.shared_prefix_tokens >= self.prompt_max:
            raise InputError("shared prefix must be shorter than the longest prompt")


@dataclass
class Requests:
    """Columnar request table, sorted by arrival."""
    arrival_ns: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray


def _lengths(rng: np.random.Generator, n: int, mean: int, cap: int, sigma: float) -> np.ndarray:
    if sigma <= 0:
        return np.full(n, min(mean, cap), dtype=np.int64)
    mu = np.log(mean) - sigma * sigma / 2   # so the mean of the log-normal is `mean`
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)


def draw(w: Workload, seed: int) -> Requests:
    """All requests of the run; the same (workload, seed) gives the same table."""
    w.validate()
    rng = np.random.default_rng(seed)
    segments = list(w.recorded_rate) or [(w.duration_s, w.rate_per_s)]
    arrivals = []
    t0 = 0.0
    for dur, rate in segments:
        if rate > 0:
            n = rng.poisson(rate * dur)
            arrivals.append(t0 + np.sort(rng.uniform(0.0, dur, n)))
        t0 += dur
    arr = np.concatenate(arrivals) if arrivals else np.zeros(0)
    n = len(arr)
    prompt = _lengths(rng, n, w.prompt_mean, w.prompt_max, w.length_sigma)
    if w.shared_prefix_tokens:
        prompt = np.maximum(prompt, w.shared_prefix_tokens + 1)
    output = _lengths(rng, n, w.output_mean, w.output_max, w.length_sigma)
    return Requests((arr * 1e9).astype(np.int64), prompt, output)

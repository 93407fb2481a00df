"""A simulated continuous-batching LLM server: a load source for the agent without a GPU.

Everything here is labelled simulated in what it emits (trace metadata, metric labels
and help text, probe name, window source). It drives the agent at realistic and at
extreme rates and exercises the verdicts across regimes; it is never the oracle for
phase-mapping accuracy (real traces are).

Modules: :mod:`.hardware` (GPU ceilings and memory), :mod:`.model` (model shapes),
:mod:`.conventions` (per-engine kernel naming and grids, from
``aggregator/data/engine_kernels.toml``), :mod:`.cost` (roofline kernel durations),
:mod:`.workload` (arrivals, lengths), :mod:`.kvpool` (block pool), :mod:`.scheduler`
(continuous batching), :mod:`.engine` (the discrete-event loop that emits columnar
events), :mod:`.metrics` (vLLM V1 Prometheus metrics), :mod:`.kineto_writer` (trace
file), :mod:`.probe` (live stream into the agent).
"""


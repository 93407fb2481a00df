"""The typed records that flow between stages, each field with its wire number.

One module says what a window is: the probes' and the aggregator's figures as the agent
folds them (:class:`Window` and what it holds), the agent's own health, a step of the
phase mapper, and the served requests joined with the GPU steps. The window builder
(``aggregator.windows``) builds a :class:`Window` directly; :func:`aggregator.wire.encode_window`
numbers its fields (and a plain dict's keys) by :data:`aggregator.wire.FIELDS`, which is
generated from these Structs
(:func:`wire_fields`): a field's wire number is declared beside it,
``Annotated[int, N(15)]``, and a name carries one number wherever it appears (a GPU's and
a phase's ``kernel_time_ns`` are both field 15). Fields without a number travel as their
names (the wire's rule for keys not in the table). Consumers read a decoded window as a
:class:`Window` with :func:`window_of` instead of walking dicts with ``.get``: a field
that is absent takes its default (None, 0 or empty), and a rename breaks the type checker,
not a dashboard.

**Adding a field**: declare it in its Struct with the next number,
``max(wire_fields().values()) + 1``; numbers are never reused or changed and names never
renamed (``tests/test_records.py`` pins every number given so far). Keep units in names.

:class:`Phase` is the one table of phase codes (``aggregator.phases`` maps kernels to
them; the window's ``phases`` maps are keyed by :attr:`Phase.label`).

This module lives with the probes (the lowest layer) so that every stage can import it.
"""
from __future__ import annotations

import enum
import typing
from typing import Annotated, Any

import msgspec


class Phase(enum.IntEnum):
    """The phase of a GPU step. The codes are stored (uint8 step and kernel columns), so
    they never change; :attr:`label` is the name records and metrics carry."""
    UNKNOWN = 0
    PREFILL = 1
    DECODE = 2
    MIXED = 3
    OTHER = 4

    @property
    def label(self) -> str:
        return self.name.lower()


#: Phase code -> name (``{0: "unknown", 1: "prefill", ...}``), for lookups by a stored code.
PHASE_NAMES: dict[int, str] = {p: p.label for p in Phase}


def N(number: int) -> msgspec.Meta:
    """The wire number of a field: ``Annotated[int, N(15)]``."""
    return msgspec.Meta(extra={"wire": number})


Num = int | float          # figures keep the type their producer gave (ints stay ints)

# ----------------------------------------------------------------- per GPU and process


class Latency(msgspec.Struct, omit_defaults=True):
    """A latency summary (launch and sync API calls, idle gaps): count and percentiles of
    a log2 histogram (see ``aggregator.windows``)."""
    count: Annotated[int, N(25)] = 0
    p50_ns: Annotated[Num | None, N(26)] = None
    p99_ns: Annotated[Num | None, N(27)] = None
    mean_ns: Annotated[Num | None, N(71)] = None
    histogram: str | None = None        # travels as its name: how the percentiles were read


class LaunchLatency(msgspec.Struct, omit_defaults=True):
    """One phase's launch latency (API call start to kernel start,
    ``aggregator.phase_figures``): percentiles of a fine histogram and the mean."""
    kernels: Num = 0
    p50_ns: Num | None = None
    p90_ns: Num | None = None            # the first release's field 69, carried by that number
    p99_ns: Num | None = None
    mean_ns: Num | None = None


class Ceilings(msgspec.Struct, omit_defaults=True):
    """A GPU's ceilings (``aggregator.ceilings``): HBM bandwidth and dense FLOP rate per
    precision."""
    gpu: Annotated[str | None, N(13)] = None
    hbm_bytes_per_s: Annotated[Num | None, N(43)] = None
    flops_per_s: Annotated[dict[str, Num | None], N(44)] = {}
    source: Annotated[str | None, N(45)] = None


class PhaseFigures(msgspec.Struct, omit_defaults=True):
    """One phase of one GPU and process in a window: the fields of
    ``aggregator.phase_figures.phase_figures`` (what analyze and the windows both publish)
    that the wire carries by number or name."""
    kernels: Annotated[Num, N(14)] = 0
    kernel_time_ns: Annotated[Num, N(15)] = 0
    busy_ns: Annotated[Num | None, N(16)] = None
    idle_ns: Annotated[Num | None, N(18)] = None
    time_share_pct: Annotated[Num | None, N(28)] = None
    flops: Annotated[Num | None, N(29)] = None
    bytes: Annotated[Num | None, N(30)] = None
    achieved_flops_per_s: Annotated[Num | None, N(31)] = None
    achieved_bytes_per_s: Annotated[Num | None, N(32)] = None
    arithmetic_intensity: Annotated[Num | None, N(33)] = None
    pct_of_peak_flops: Annotated[Num | None, N(34)] = None
    pct_of_peak_bytes: Annotated[Num | None, N(35)] = None
    evidence: Annotated[list[str], N(36)] = []
    work_source: Annotated[str | None, N(37)] = None
    steps: Annotated[Any, N(38)] = None          # a count in windows, a list in analyses
    verdict: Annotated[str | None, N(10)] = None
    kv_read_bytes_per_s: Annotated[Num | None, N(106)] = None
    kv_read_source: Annotated[str | None, N(107)] = None
    achieved_bytes_with_kv_per_s: Annotated[Num | None, N(108)] = None
    # travel as names
    share_of_gpu_time_ratio: Num | None = None
    work_busy_ns: Num | None = None
    work_coverage_ratio: Num | None = None
    window_ns: Num | None = None                 # first kernel start to last end of the phase
    idle_ratio: Num | None = None
    gaps: Num | None = None
    median_gap_ns: Num | None = None
    median_kernel_ns: Num | None = None
    idle_in_launch_calls_ratio: Num | None = None
    idle_in_sync_calls_ratio: Num | None = None
    work_by_source: dict[str, dict[str, Any]] = {}   # per work source (shapes, model): its figures
    ridge_point: Num | None = None
    ceiling_dtype: str | None = None
    peak_flops_per_s: Num | None = None
    peak_bytes_per_s: Num | None = None
    launch_latency: LaunchLatency | None = None
    work_estimated: bool = False     # model work over token counts read from kernel grids


class GpuProcess(msgspec.Struct, omit_defaults=True):
    """One (GPU, served process) of a window: what its kernels, copies and API calls did."""
    device: Annotated[Any, N(7)] = None          # the CUDA ordinal (an int from every producer)
    pid: Annotated[Any, N(12)] = None
    gpu: Annotated[str | None, N(13)] = None     # the GPU's name
    kernels: Annotated[Num, N(14)] = 0
    kernel_time_ns: Annotated[Num, N(15)] = 0
    busy_ns: Annotated[Num, N(16)] = 0
    span_ns: Annotated[Num, N(17)] = 0
    idle_ns: Annotated[Num, N(18)] = 0
    copy_bytes: Annotated[dict[str, Num], N(19)] = {}
    launch: Annotated[Latency | None, N(20)] = None
    sync: Annotated[Latency | None, N(21)] = None
    phases: Annotated[dict[str, PhaseFigures], N(22)] = {}
    ceilings: Annotated[Ceilings | None, N(23)] = None
    phase_source: Annotated[str | None, N(24)] = None
    source: Annotated[str | None, N(45)] = None  # the event source (cupti, replay, simulated)
    launch_tids: Annotated[list[Any], N(105)] = []
    # travels as its name
    idle_gaps: Latency | None = None


# ----------------------------------------------------------------- scheduling


class SchedThread(msgspec.Struct, omit_defaults=True):
    """One watched thread's scheduling figures over the window."""
    pid: Annotated[Any, N(12)] = None
    tid: Annotated[Any, N(53)] = None
    comm: Annotated[str | None, N(54)] = None
    on_cpu_ns: Annotated[Num | None, N(55)] = None
    runq_wait_ns: Annotated[Num | None, N(56)] = None
    blocked_ns: Annotated[Num | None, N(57)] = None
    voluntary_switches: Annotated[Num | None, N(58)] = None
    involuntary_switches: Annotated[Num | None, N(59)] = None
    # travel as names
    launches: Num | None = None     # CUDA launch calls the sched probe counted from it
    oncpu_ns: Num | None = None     # the sched probe's own spellings (probes.sched_accounting)
    runq_ns: Num | None = None
    off_cpu_ns: Num | None = None


class SchedFigures(msgspec.Struct, omit_defaults=True):
    """One scheduling source's figures: its threads (a list, or a map by tid)."""
    threads: Annotated[Any, N(60)] = None


# ----------------------------------------------------------------- device


class DeviceSample(msgspec.Struct, omit_defaults=True):
    """Who one NVML device sample is about (``probes.nvml``; its figures are read by
    ``aggregator.device_metrics``)."""
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    gpu_name: str | None = None


class DeviceSamples(msgspec.Struct):
    """One device source's record of the window's ``device`` map (``probes.nvml``): its
    samples, each read as a :class:`DeviceSample` by who reads it (a sample of another
    shape is skipped by that reader, not refused with the others)."""
    devices: list[Any] = []


# ----------------------------------------------------------------- engine


class LatencyHistogram(msgspec.Struct, omit_defaults=True):
    """One of the engine's lifetime latency histograms: cumulative counts per upper bound
    (the last is +Inf), as the engine exports them."""
    bounds: Annotated[list[Num], N(103)] = []
    cumulative: Annotated[list[Num], N(104)] = []
    count: Annotated[Num | None, N(25)] = None
    sum: Num | None = None


class AlertState(msgspec.Struct, omit_defaults=True):
    """One of the agent's own engine alerts (``aggregator.alerts.AlertTracker.record``)."""
    firing: bool = False
    since_ts_ns: int | None = None
    value: Num | None = None
    message: str = ""


class EngineFigures(msgspec.Struct, omit_defaults=True):
    """One serving endpoint's figures over the window (``aggregator.engine_metrics``)."""
    engine: Annotated[str | None, N(8)] = None
    pid: Annotated[Any, N(12)] = None
    queue_mean_s: Annotated[Num | None, N(74)] = None
    prefill_mean_s: Annotated[Num | None, N(75)] = None
    decode_mean_s: Annotated[Num | None, N(76)] = None
    ttft_mean_s: Annotated[Num | None, N(77)] = None
    e2e_mean_s: Annotated[Num | None, N(78)] = None
    queue_share_of_ttft_ratio: Annotated[Num | None, N(79)] = None
    segment_kinds: Annotated[dict[str, str], N(80)] = {}
    num_swapped_requests: Annotated[Num | None, N(81)] = None
    external_prefix_cache_hit_ratio: Annotated[Num | None, N(82)] = None
    prompt_tokens_cached_ratio: Annotated[Num | None, N(83)] = None
    kv_evicted_tokens: Annotated[Num | None, N(84)] = None
    kv_eviction_rate_tokens_per_s: Annotated[Num | None, N(85)] = None
    kv_eviction_source: Annotated[str | None, N(86)] = None
    estimated_flops_per_gpu: Annotated[Num | None, N(87)] = None
    estimated_read_bytes_per_gpu: Annotated[Num | None, N(88)] = None
    estimated_write_bytes_per_gpu: Annotated[Num | None, N(89)] = None
    estimated_flops_per_gpu_per_s: Annotated[Num | None, N(90)] = None
    estimated_bytes_per_gpu_per_s: Annotated[Num | None, N(91)] = None
    estimated_arithmetic_intensity: Annotated[Num | None, N(92)] = None
    work_estimate_source: Annotated[str | None, N(93)] = None
    preemption_episode_active: Annotated[bool | None, N(94)] = None
    preemption_episode_elapsed_s: Annotated[Num | None, N(95)] = None
    preemption_episode_preemptions: Annotated[Num | None, N(96)] = None
    preemption_episode_baseline_waiting: Annotated[Num | None, N(97)] = None
    preemption_episodes_total: Annotated[Num | None, N(98)] = None
    preemption_episodes_recovered_total: Annotated[Num | None, N(99)] = None
    preemption_recovery_s: Annotated[Num | None, N(100)] = None
    preemption_last_recovery_s: Annotated[Num | None, N(101)] = None
    latency_histograms: Annotated[dict[str, LatencyHistogram], N(102)] = {}
    # travel as names
    kv_usage_ratio: Num | None = None
    queue_time_p50_s: Num | None = None
    queue_time_p99_s: Num | None = None
    ttft_p50_s: Num | None = None
    ttft_p99_s: Num | None = None
    itl_p50_s: Num | None = None
    itl_p99_s: Num | None = None
    num_running_requests: Num | None = None
    num_waiting_requests: Num | None = None
    preemption_rate_per_s: Num | None = None
    prefix_cache_hit_ratio: Num | None = None
    version_hint: str | None = None
    model_names: Any = None
    simulated: bool | None = None
    alerts: dict[str, AlertState] = {}
    kv_usage_max_ratio: Num | None = None      # the window's highest KV usage (the verdict weighs it)
    max_running_requests: Num | None = None    # the engine's batch cap, where it says
    # what the verdict reads besides (aggregator.verdict.evidence)
    kv_pool_tokens: Num | None = None
    preemptions: Num | None = None             # in the window
    num_waiting_change: Num | None = None
    queue_time_mean_s: Num | None = None
    retracted_requests_last_tick: Num | None = None   # SGLang's gauge, where no counter
    # Where the window's histogram puts a percentile in its first bucket or past its last,
    # there is no interpolated value: the kind says which, and the bucket bound stands in
    # (aggregator.engine_metrics.engine_record).
    queue_time_p50_kind: str | None = None
    queue_time_p50_lower_s: Num | None = None
    queue_time_p50_upper_s: Num | None = None
    queue_time_p99_kind: str | None = None
    queue_time_p99_lower_s: Num | None = None
    queue_time_p99_upper_s: Num | None = None
    ttft_p50_kind: str | None = None
    ttft_p50_lower_s: Num | None = None
    ttft_p50_upper_s: Num | None = None
    ttft_p99_kind: str | None = None
    ttft_p99_lower_s: Num | None = None
    ttft_p99_upper_s: Num | None = None
    itl_p50_kind: str | None = None
    itl_p50_lower_s: Num | None = None
    itl_p50_upper_s: Num | None = None
    itl_p99_kind: str | None = None
    itl_p99_lower_s: Num | None = None
    itl_p99_upper_s: Num | None = None


class ScrapeError(msgspec.Struct):
    """One failed scrape the engine probe reported (``probes.engine``), kept by the window
    builder until its endpoint answers."""
    endpoint: str | None = None
    error: str | None = None


class EngineSource(msgspec.Struct):
    """One engine source's record of the window's ``engine`` map (``aggregator.windows``:
    the tracker's endpoints by URL, each read as :class:`EngineFigures` by who reads it, and
    the latest failed scrapes). A source whose record has no ``endpoints`` map is itself one
    endpoint's figures (a plain record given to ``WindowBuilder.add_engine``)."""
    endpoints: dict[str, Any] | None = None
    errors: list[Any] = []


# ----------------------------------------------------------------- agent health


class ProbeCounters(msgspec.Struct, omit_defaults=True):
    """One probe's cumulative counters (``probes.probe.Probe.counters``; the values of
    :attr:`Health.probes`, where a probe may add counters of its own by name)."""
    records: Annotated[Num, N(48)] = 0
    drops: Annotated[Num, N(49)] = 0
    errors: Annotated[Num, N(50)] = 0
    bpf_run_time_ns: Annotated[Num | None, N(52)] = None


class EngineProbeCounters(ProbeCounters, omit_defaults=True):
    """The engine probe's counters (``probes.engine``): its failed scrapes by kind
    (timeout, too_large, connect, http_status, ...)."""
    scrape_failures: dict[str, Num] = {}


class CuptiProbeCounters(ProbeCounters, omit_defaults=True):
    """The CUPTI probe's own counters (``probes.cupti``, its socket server and name
    matching) that ``/metrics`` exports; a counter the probe does not keep is None."""
    # connections refused at the descriptor-derived limit, at one user's share, peers cut
    # for claiming another pid
    server_refused_connections: Num | None = None
    server_refused_connections_uid: Num | None = None
    server_rejected_peers: Num | None = None
    # connections cut after they were accepted (agent.prometheus.WindowCollector.CUPTI_CUTS)
    server_process_gone_cut: Num | None = None
    server_pid_reused_cut: Num | None = None
    server_idle_peer_cut: Num | None = None
    server_evicted_fair_share: Num | None = None
    server_identity_dropped_batches: Num | None = None
    demangler_seccomp_kills: Num | None = None
    names_not_classified: Num | None = None
    clock_disagreements: Num | None = None


class ProbeMessage(msgspec.Struct):
    """A message of the ``sched``, ``device`` and ``engine`` topics: what one probe
    delivered, as it delivered it (``agent.daemon``)."""
    source: Annotated[str, N(45)]
    data: Annotated[Any, N(68)]


class Health(msgspec.Struct, omit_defaults=True):
    """The agent's own cost and counters (``agent.health``; the window's ``agent`` record
    and the ``health`` topic)."""
    cpu_pct: Annotated[Num | None, N(46)] = None
    rss_bytes: Annotated[Num | None, N(47)] = None
    drops: Annotated[Any, N(49)] = None          # a total, or a map by probe
    errors: Annotated[Any, N(50)] = None
    records_per_s: Annotated[Num | None, N(51)] = None
    bpf_run_time_ns: Annotated[Num | None, N(52)] = None
    # travel as names
    probes: dict[str, dict[str, Any]] = {}     # per probe: ProbeCounters and its own counters
    publisher_drops: Num | None = None
    publisher_drops_by_topic: dict[str, Any] = {}
    metrics_server: dict[str, Any] = {}
    records_total: Num | None = None
    dropped_records: Num | None = None
    dropped_batches: Num | None = None
    window_drops: Num | None = None
    window_fold_errors: Num | None = None
    window_open_steps_cut: Num | None = None
    cupti_processes_taken_over: Num | None = None
    cupti_taken_over_by_uid: Any = None        # {uid: processes}
    # the rest of what the daemon reports of itself (agent.daemon.Agent.close_window)
    peak_rss_bytes: Num | None = None
    uptime_s: Num | None = None
    requests_joined: Num | None = None
    requests_dropped: Num | None = None
    request_steps_dropped: Num | None = None
    request_stories_unpublished: Num | None = None
    publisher_errors: Num | None = None
    publisher_stalls: Num | None = None
    publisher_lossy_sent: Num | None = None
    publisher_bytes_sent: Num | None = None
    subscriptions: Num | None = None
    bad_frames: Num | None = None
    reloads: Num | None = None
    reloads_refused: Num | None = None
    reloads_deferred: Num | None = None
    loop_errors: Num | None = None
    watchdog_skipped: Num | None = None
    cupti_taken_over: Any = None               # the processes another tool holds CUPTI in
    cupti_reclaims_requested: Num | None = None
    cupti_reclaim_requests_rejected: Num | None = None
    sink: "SinkState | None" = None            # the object-storage sink, when on (agent.sink_supervisor)


class SinkState(msgspec.Struct, omit_defaults=True):
    """The object-storage sink's state and counters (``agent.sink_supervisor``: the agent's
    sink child, ``agent.object_sink``, summed over the child's restarts). Travels by name."""
    state: str = "off"             # off | running | restarting | unavailable
    url: str = ""
    restarts: int = 0              # the child ended (crashed, killed) and was started again
    messages: int = 0              # stream messages journaled
    missed_messages: int = 0       # published but never taken (sequence gaps: past the hand-off's bound)
    files_written: int = 0
    bytes_written: int = 0
    files_uploaded: int = 0
    bytes_uploaded: int = 0
    upload_errors: int = 0         # failed uploads, each retried later (backoff 1 s doubling to 60 s)
    dropped_files: int = 0         # deleted unsent past the spool cap or the free-space floor
    dropped_bytes: int = 0
    replayed_messages: int = 0     # taken again from a dead child's journal
    torn_frames: int = 0
    handed_over_messages: int = 0  # taken from the agent's hand-off at a child's start (agent/sink_handoff.py)
    duplicate_messages: int = 0    # in both the hand-off and the live stream: taken once
    handoff_ring_bytes: int = 0    # gauge: what the agent keeps for the next hand-off
    handoff_ring_dropped: int = 0  # messages that left that ring (the oldest first) unneeded or not
    spool_bytes: int = 0           # gauge: the spool now
    spool_files: int = 0           # gauge: complete files waiting for upload
    last_error: str = ""
    status_age_s: float = 0.0      # since the child last wrote its status


# ----------------------------------------------------------------- steps


class StepTokens(msgspec.Struct, omit_defaults=True):
    prefill: int | None = None
    decode: int | None = None


class Step(msgspec.Struct, omit_defaults=True):
    """One forward step as an analysis reports it (``aggregator.analysis``)."""
    index: Annotated[int, N(67)] = 0
    start_ns: Annotated[int, N(1)] = 0
    end_ns: Annotated[int, N(2)] = 0
    device: Annotated[int | None, N(7)] = None
    phase: Annotated[str, N(39)] = "unknown"
    evidence: Annotated[list[str], N(36)] = []
    kernels: Annotated[int, N(14)] = 0
    busy_ns: Annotated[int, N(16)] = 0
    tokens: Annotated[StepTokens | None, N(40)] = None


# ----------------------------------------------------------------- requests


class Culprit(msgspec.Struct, frozen=True):
    """A co-batched request that added decode time to another (``aggregator.request_join``)."""
    request_id: Annotated[str, N(124)]
    kind: Annotated[str, N(141)]         # "prefill_chunk" | "long_sequence" | both, joined by "+"
    added_ns: Annotated[int, N(142)]
    # The culprit's size: the tokens it prefilled in the steps it shared (its prompt, or
    # its prompt + the tokens it had generated when it re-prefilled after a preemption),
    # else (a long sequence only) its prompt tokens.
    tokens: Annotated[int, N(40)]


class Pause(msgspec.Struct, frozen=True):
    """A preemption of a request, until it was resumed (or until it ended); and, where the
    request re-prefilled after it (recompute preemption), that re-prefill's GPU time and
    when its last step ended (None: no re-prefill joined, or an older producer)."""
    start_ns: Annotated[int, N(1)]
    end_ns: Annotated[int, N(2)]
    recompute_ns: Annotated[int | None, N(167)] = None
    recompute_end_ns: Annotated[int | None, N(170)] = None


class RequestStory(msgspec.Struct, frozen=True):
    """One served request's life, joined with the GPU steps it ran in."""
    request_id: Annotated[str, N(124)]
    engine: Annotated[str, N(8)]
    start_ns: Annotated[int, N(1)]
    end_ns: Annotated[int, N(2)]
    e2e_ns: Annotated[int, N(125)]
    queue_ns: Annotated[int, N(126)]                        # -1: the engine did not report it
    kv_usage_max_queued_ratio: Annotated[float, N(127)]     # -1: no KV sample while it waited
    kv_full_while_queued: Annotated[bool, N(128)]
    prefill_ns: Annotated[int, N(129)]
    prefill_chunks: Annotated[int, N(130)]
    decode_ns: Annotated[int, N(111)]
    decode_steps: Annotated[int, N(131)]
    ns_per_token: Annotated[float, N(132)]       # decode time per generated token (-1: unknown)
    dragged_ns: Annotated[int, N(112)]
    dragged_by_prefill_ns: Annotated[int, N(133)]
    dragged_by_long_ns: Annotated[int, N(134)]
    dragged_source: Annotated[str, N(122)]       # measured | roofline_estimate | none
    alone_decode_ns: Annotated[int, N(135)]      # decode time without the culprits
    preemptions: Annotated[int, N(136)]          # -1: the engine did not say
    recovery_ns: Annotated[int, N(137)]          # time preempted, until resumed (-1: not measured)
    prompt_tokens: Annotated[int, N(138)]
    completion_tokens: Annotated[int, N(139)]
    culprits: Annotated[list[Culprit], N(140)] = []
    trace_id: Annotated[str, N(162)] = ""        # the engine span's trace (hex), for exemplars
    # Time it was preempted inside its prefill and decode (left out of both: it was in no
    # GPU step then), and the pauses themselves (the first MAX_STORY_PAUSES).
    paused_ns: Annotated[int, N(165)] = 0
    pauses: Annotated[list[Pause], N(166)] = []
    # The steps in which it re-prefilled (prompt + tokens generated so far) after a pause
    # in its decode, as recompute preemption makes it: their GPU time summed, and their
    # count; left out of decode_ns, decode_steps, ns_per_token and alone_decode_ns.
    recompute_ns: Annotated[int, N(167)] = 0
    recompute_steps: Annotated[int, N(168)] = 0


class Exemplar(msgspec.Struct, frozen=True):
    """The slowest request of one bucket of the window's end-to-end histogram."""
    bucket: Annotated[int, N(161)]       # index into aggregator.request_join.E2E_BOUNDS_S (its length: +Inf)
    request_id: Annotated[str, N(124)]
    trace_id: Annotated[str, N(162)]
    e2e_ns: Annotated[int, N(125)]


class WindowRequests(msgspec.Struct):
    """A window's per-request aggregates (never one series per request)."""
    requests: Annotated[int, N(109)] = 0
    requests_dropped: Annotated[int, N(110)] = 0
    decode_ns: Annotated[int, N(111)] = 0
    dragged_ns: Annotated[int, N(112)] = 0
    dragged_share_ratio: Annotated[float, N(113)] = 0.0
    queue_p99_ns: Annotated[int, N(114)] = 0
    prefill_p99_ns: Annotated[int, N(115)] = 0
    decode_p99_ns: Annotated[int, N(116)] = 0
    dragged_p99_ns: Annotated[int, N(117)] = 0
    e2e_p99_ns: Annotated[int, N(118)] = 0
    top_culprit_id: Annotated[str, N(119)] = ""
    top_culprit_added_ns: Annotated[int, N(120)] = 0
    top_culprit_tokens: Annotated[int, N(121)] = 0
    dragged_source: Annotated[str, N(122)] = "none"      # aggregator.request_join.SOURCE_NONE
    slowest: Annotated[list[RequestStory], N(123)] = []
    e2e_total_ns: Annotated[int, N(158)] = 0
    e2e_bucket_counts: Annotated[list[int], N(159)] = []    # per E2E_BOUNDS_S bucket and +Inf, not cumulative
    exemplars: Annotated[list[Exemplar], N(160)] = []
    # The requests' re-prefill time after preemption (RequestStory.recompute_ns, summed),
    # and its share of their decode and re-prefill time together.
    recompute_ns: Annotated[int, N(167)] = 0
    recompute_share_ratio: Annotated[float, N(169)] = 0.0


class RequestsMessage(msgspec.Struct):
    """A message of the ``requests`` topic: the stories a window told."""
    end_ns: Annotated[int, N(2)]
    stories: Annotated[list[RequestStory], N(143)]


# ----------------------------------------------------------------- stragglers


class RankStragglers(msgspec.Struct, frozen=True):
    """One rank of a tensor-parallel group over the window (``aggregator.straggler_window``)."""
    pid: Annotated[int, N(12)]
    device: Annotated[int, N(7)]
    last_count: Annotated[int, N(147)]       # collectives of this window where it arrived last
    wait_ns: Annotated[int, N(148)]          # time its collectives spun waiting for the last rank


class GroupStragglers(msgspec.Struct, frozen=True):
    """One tensor-parallel group's collectives over the window, and its straggler."""
    ranks: Annotated[list[RankStragglers], N(146)]
    collectives: Annotated[int, N(149)]
    waiting_share_ratio: Annotated[float, N(150)]          # of the ranks' time since the last report, waiting
    straggler_pid: Annotated[int, N(151)]                  # -1: no collective this window
    straggler_device: Annotated[int, N(152)]
    straggler_last_share_ratio: Annotated[float, N(153)]
    late_by_p50_ns: Annotated[int, N(154)]
    late_by_p99_ns: Annotated[int, N(155)]
    cause: Annotated[str, N(156)]                          # kernel | copy | host | ""
    # The launch threads' share of the window off-CPU (run queue + blocked), from the
    # scheduling probe, for the straggler and the median of the other ranks (-1: unknown):
    # a "host" straggler whose launch thread was off-CPU much more than the others' is
    # held back by the CPU (aggregator.straggler_window.annotate_launch_threads).
    straggler_launch_off_cpu_ratio: Annotated[float, N(163)] = -1.0
    others_launch_off_cpu_ratio: Annotated[float, N(164)] = -1.0


class WindowStragglers(msgspec.Struct):
    """The window's ``stragglers`` record."""
    groups: Annotated[list[GroupStragglers], N(145)] = []
    straggler_kernels_dropped: Annotated[int, N(157)] = 0  # cumulative: over MAX_HELD_KERNELS


# ----------------------------------------------------------------- verdicts


class VerdictRecord(msgspec.Struct, omit_defaults=True):
    """What the views read of one verdict record of the window's ``verdict`` list
    (``aggregator.verdict.verdict_record``: the verdict of one GPU and process, its face
    and the figures that place it); its other keys (reasons, faces, caveats) are read by
    ``aggregator.answer``."""
    device: Any = None
    pid: Any = None
    verdict: str | None = None
    face: str | None = None
    phase_pct_of_peak_bytes: Num | None = None
    phase_pct_of_peak_flops: Num | None = None
    kv_usage_ratio: Num | None = None
    gpu_idle_ratio: Num | None = None


# ----------------------------------------------------------------- the window


class Window(msgspec.Struct, omit_defaults=True):
    """What the probes saw in one window, folded (``aggregator.windows``)."""
    start_ns: Annotated[int, N(1)] = 0
    end_ns: Annotated[int, N(2)] = 0
    duration_ns: Annotated[int, N(3)] = 0
    host: Annotated[str | None, N(4)] = None
    sources: Annotated[list[str], N(5)] = []
    gpus: Annotated[list[GpuProcess], N(6)] = []
    device: Annotated[dict[str, Any], N(7)] = {}    # per source: {"devices": [sample, ...]}
    engine: Annotated[dict[str, Any], N(8)] = {}    # per source: {"endpoints": {url: EngineFigures}}
    sched: Annotated[dict[str, Any], N(9)] = {}     # per source: SchedFigures
    verdict: Annotated[Any, N(10)] = None           # a list of verdicts per GPU and process
    agent: Annotated[Health, N(11)] = msgspec.field(default_factory=Health)
    requests: Annotated[WindowRequests | None, N(109)] = None
    stragglers: Annotated[WindowStragglers | None, N(144)] = None


#: Every Struct whose fields are numbered; :func:`wire_fields` reads them.
RECORDS = (Window, GpuProcess, PhaseFigures, Latency, LaunchLatency, Ceilings, SchedThread, SchedFigures,
           LatencyHistogram, EngineFigures, ProbeCounters, ProbeMessage, Health, Step, StepTokens, Culprit, Pause,
           RequestStory, Exemplar,
           WindowRequests, RequestsMessage, RankStragglers, GroupStragglers, WindowStragglers)

#: Numbers the first release gave to names no typed record declares (its guesses at the
#: device and engine records, which carry other names today). Kept so that a recording of
#: that time still decodes them by name; never given to another name.
RETIRED: dict[str, int] = {
    "kv_usage": 61, "num_running": 62, "num_waiting": 63, "preemptions_total": 64,
    "prefix_cache_hit_rate": 65, "name": 66, "p90_ns": 69, "p95_ns": 70, "reason": 72,
    "value": 73, "prefill_tokens": 41, "decode_tokens": 42,
}


def _numbers(cls) -> dict[str, int]:
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        for m in getattr(hint, "__metadata__", ()):
            if isinstance(m, msgspec.Meta) and m.extra and "wire" in m.extra:
                out[name] = m.extra["wire"]
    return out


def wire_fields() -> dict[str, int]:
    """Name -> wire number of every numbered field of :data:`RECORDS` and :data:`RETIRED`.
    ValueError if one name has two numbers or one number two names."""
    table: dict[str, int] = dict(RETIRED)
    for cls in RECORDS:
        for name, no in _numbers(cls).items():
            if table.setdefault(name, no) != no:
                raise ValueError(f"{cls.__name__}.{name} is field {no}, elsewhere {table[name]}")
    by_number: dict[int, str] = {}
    for name, no in table.items():
        if by_number.setdefault(no, name) != name:
            raise ValueError(f"field {no} is both {by_number[no]!r} and {name!r}")
    return dict(sorted(table.items(), key=lambda kv: kv[1]))


def window_of(record: dict | Window) -> Window:
    """A decoded window (the dict of ``wire.decode_window`` or ``WindowBuilder.close``)
    as a :class:`Window`. Keys it does not declare are ignored; ``msgspec.ValidationError``
    when a declared one has the wrong type. A :class:`Window` (what the builder closes) is
    returned as it is."""
    if isinstance(record, Window):
        return record
    return msgspec.convert(record, Window)


def window_sections_of(record: dict | Window) -> tuple[Window, dict[str, str]]:
    """A decoded window as a :class:`Window` for a view that shows what it can: a section
    (a top-level field) of the wrong type is left at its default and named, with
    msgspec's reason, in the second value (empty when the record is whole). A record that
    is not a map at all raises ``msgspec.ValidationError``."""
    try:
        return window_of(record), {}
    except msgspec.ValidationError:
        if not isinstance(record, dict):
            raise
    good, bad = {}, {}
    for name in Window.__struct_fields__:
        if name not in record:
            continue
        try:
            msgspec.convert({name: record[name]}, Window)
        except msgspec.ValidationError as exc:
            bad[name] = str(exc)
            continue
        good[name] = record[name]
    return msgspec.convert(good, Window), bad

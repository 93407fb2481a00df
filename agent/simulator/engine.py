"""The discrete-event loop of a simulated continuous-batching server on one GPU.

:class:`SimEngine` advances a simulated clock step by step: admit the requests that have
arrived, schedule a step (:mod:`.scheduler`), plan its kernels (:mod:`.cost`), lay the
step out on the CPU launch thread and the GPU stream, and update request states and the
engine's metrics at the step's end. It emits columnar events (``probes.events`` dtypes)
into a bounded buffer that :meth:`SimEngine.drain` hands over as a
:class:`probes.events.Trace` whose ``meta["source"]`` is ``"simulated"``.

Timeline of one step (all on the simulated clock, offset by ``time_base_ns``):
the CPU thread spends ``host_overhead_ns`` scheduling and preparing inputs, then issues
one launch API call per kernel (``launch_api_ns`` apart; the kernel is submitted half
way through the call); the GPU runs each kernel at ``max(previous end, submission)``;
then a ``cudaMemcpyAsync`` of the sampled token ids (device to host) and a
``cudaStreamSynchronize`` that returns when the copy is done. The next step starts when
the CPU is back. So a step whose kernels are shorter than their launches is
launch-bound and shows GPU idle gaps, as a real eager engine does.

Determinism: the same :class:`SimConfig` and seed give the same events, to the
nanosecond.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ridgeline.probes.events import (
    API_DOMAIN_RUNTIME,
    API_DTYPE,
    API_LAUNCH,
    API_MEMCPY,
    API_SYNC,
    COPY_DTOH,
    COPY_DTYPE,
    COPY_KIND_MEMCPY,
    KERNEL_DTYPE,
    RANGE_DTYPE,
    RANGE_GPU_ANNOTATION,
    RANGE_PROFILER_STEP,
    RANGE_USER_ANNOTATION,
    Device,
    NameTable,
    Trace,
    empty,
)

from .conventions import load_engine
from .cost import Efficiency, Planner, StepShape
from .hardware import GpuSpec, gpu_spec
from .kvpool import KvPool
from .metrics import SimMetrics
from .model import SimModel, load_model
from .scheduler import Request, Scheduler, SchedulerConfig
from .workload import Requests, Workload, draw

# CUPTI runtime callback ids (cupti_runtime_cbid.h): cudaLaunchKernel_v7000,
# cudaMemcpyAsync_v3020, cudaStreamSynchronize_v3020.
CBID_LAUNCH_KERNEL = 211
CBID_MEMCPY_ASYNC = 41
CBID_STREAM_SYNC = 131

COMPUTE_STREAM = 7
MEMCPY_API_NS = 6_000
POSTPROCESS_NS = 60_000     # detokenise / output processing after the sync
DTOH_COPY_NS = 2_000


def vllm_step_label(q_lens: np.ndarray, ctx_lens: np.ndarray) -> str:
    """vLLM's detailed step annotation (PR #37524, the form aggregator.phases parses):
    ``execute_{tokens}_context_{n}(sq..sk..sqsq..sqsk..)_generation_{m}(sq..sk..sqsq..sqsk..)``
    where, over the step's context (prefill) or generation (decode) sequences, ``sq`` sums
    the query tokens, ``sk`` the key tokens each attends over (its KV length after the step:
    cached + new), ``sqsq`` the squared query lengths and ``sqsk`` query x key. The
    generation ``sk`` is what decode reads from the KV cache, which the short form
    (``execute_context_N(T_S)_generation_M(G)``) does not carry."""
    q = q_lens.astype(np.int64)
    k = q + ctx_lens.astype(np.int64)
    dec = (q_lens == 1) & (ctx_lens > 0)

    def sums(sel) -> str:
        qs, ks = q[sel], k[sel]
        return f"sq{int(qs.sum())}sk{int(ks.sum())}sqsq{int((qs * qs).sum())}sqsk{int((qs * ks).sum())}"

    return (f"execute_{int(q.sum())}_context_{int((~dec).sum())}({sums(~dec)})"
            f"_generation_{int(dec.sum())}({sums(dec)})")


@dataclass
class SimConfig:
    gpu: str = "h100"
    model: str = "llama-3-8b"
    engine: str = "vllm"
    workload: Workload = field(default_factory=Workload)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    efficiency: Efficiency = field(default_factory=Efficiency)
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: float | None = None   # overrides the memory-derived KV budget
    block_size: int = 16
    device: int = 0
    pid: int = 90_000
    tid: int = 90_000
    annotations: bool = True
    time_base_ns: int = 0
    max_buffer_kernels: int = 2_000_000   # bounded event buffer; beyond it steps are dropped and counted
    emit_events: bool = True              # False: timing and metrics only (engine-side studies)


@dataclass
class StepRecord:
    start_ns: int
    end_ns: int
    gpu_start_ns: int
    gpu_end_ns: int
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    sequences: int
    running: int
    waiting: int
    kv_usage_ratio: float
    preemptions: int
    kernels: int
    flops: float
    bytes: float


class SimEngine:
    """One simulated engine on one GPU. Not thread-safe; drive it from one thread."""

    def __init__(self, cfg: SimConfig, seed: int = 0, *, metrics: bool = True,
                 gpu: GpuSpec | None = None, model: SimModel | None = None, keep_steps: int = 100_000):
        self.cfg = cfg
        self.seed = seed
        self.gpu = gpu or gpu_spec(cfg.gpu)
        self.model = model or load_model(cfg.model)
        self.conv = load_engine(cfg.engine, self.model.dims())
        self.planner = Planner(self.conv, self.model, self.gpu, cfg.efficiency)
        self.pool = KvPool.sized(self.gpu.memory_bytes, self.model.weight_bytes, self.model.kv_bytes_per_token,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization, block_size=cfg.block_size,
                                 kv_cache_bytes=cfg.kv_cache_bytes)
        self.sched = Scheduler(cfg.scheduler, self.pool, cfg.workload.shared_prefix_tokens)
        self.requests = draw(cfg.workload, seed)
        self._next_req = 0
        self._laps = 1
        self.clock_ns = 0
        self.gpu_free_ns = 0
        self.step_index = 0
        self.correlation = 1
        self.names = NameTable()
        self._api_ids = {n: self.names.intern(n) for n in (self.conv.launch_api, "cudaMemcpyAsync",
                                                          "cudaStreamSynchronize")}
        self.metrics = SimMetrics(self.model.name, block_size=cfg.block_size, num_gpu_blocks=self.pool.total_blocks,
                                  gpu_memory_utilization=cfg.gpu_memory_utilization) if metrics else None
        self._buf: dict[str, list[np.ndarray]] = {"kernels": [], "api": [], "copies": [], "ranges": []}
        self._buf_kernels = 0
        self.steps: deque[StepRecord] = deque(maxlen=keep_steps)
        self.finished: deque[Request] = deque(maxlen=keep_steps)
        self.finished_total = 0
        self.aborted = 0
        self.dropped_kernels = 0
        self.emitted_kernels = 0
        self.preemptions_total = 0
        self._prefix_seen = (0, 0)
        self.device = Device(cfg.device, self.gpu.name, sm_count=self.gpu.sm_count,
                             memory_total_bytes=int(self.gpu.memory_bytes),
                             properties={"simulated": True})

    # ---- public -------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """No request left to arrive, queue or run."""
        return (self._next_req >= len(self.requests.arrival_ns) and not self.sched.running
                and not self.sched.waiting)

    def run_until(self, t_ns: int, max_steps: int | None = None) -> int:
        """Run steps that start before simulated time ``t_ns`` (at most ``max_steps``);
        returns steps run."""
        n = 0
        while self.clock_ns < t_ns and (max_steps is None or n < max_steps):
            self._admit_arrivals()
            if not self.sched.running and not self.sched.waiting:
                if self._next_req >= len(self.requests.arrival_ns):
                    self.clock_ns = t_ns
                    break
                nxt = int(self.requests.arrival_ns[self._next_req])
                if nxt >= t_ns:
                    self.clock_ns = t_ns
                    break
                self.clock_ns = max(self.clock_ns, nxt)
                continue
            if self._step():
                n += 1
        self._update_gauges()
        return n

    def run(self, max_steps: int | None = None) -> int:
        """Run until every request has finished (or ``max_steps``)."""
        n = 0
        while not self.done and (max_steps is None or n < max_steps):
            self._admit_arrivals()
            if not self.sched.running and not self.sched.waiting:
                self.clock_ns = max(self.clock_ns, int(self.requests.arrival_ns[self._next_req]))
                continue
            if self._step():
                n += 1
        self._update_gauges()
        return n

    def extend(self) -> None:
        """Append another run of the workload (the next seed), starting where the
        current one's arrivals end, so a live source can run indefinitely. Requests
        already admitted are dropped from the table, keeping memory flat."""
        w = self.cfg.workload
        more = draw(w, self.seed + self._laps)
        offset = int(self._laps * (sum(d for d, _ in w.recorded_rate) if w.recorded_rate else w.duration_s) * 1e9)
        self._laps += 1
        rest = slice(self._next_req, None)
        self.requests = Requests(np.concatenate([self.requests.arrival_ns[rest], more.arrival_ns + offset]),
                                 np.concatenate([self.requests.prompt_len[rest], more.prompt_len]),
                                 np.concatenate([self.requests.output_len[rest], more.output_len]))
        self._next_req = 0

    def forward(self, q_lens, ctx_lens=None) -> StepRecord:
        """One step of a fixed shape, outside the scheduler (a profiled forward pass:
        ``q_lens[i]`` new tokens of sequence i on ``ctx_lens[i]`` cached ones)."""
        q = np.asarray(q_lens, dtype=np.int64)
        ctx = np.zeros_like(q) if ctx_lens is None else np.asarray(ctx_lens, dtype=np.int64)
        shape = StepShape(q, ctx, np.ones(len(q), dtype=bool))
        plan = self.planner.plan(shape)
        now = self.clock_ns
        end_cpu, gpu_start, gpu_end = self._emit(plan, shape, [])
        dec = int(q[(q == 1) & (ctx > 0)].sum())
        rec = StepRecord(now, end_cpu, gpu_start, gpu_end, shape.tokens, shape.tokens - dec, dec, shape.sequences,
                         0, 0, 0.0, 0, len(plan.dur_ns), float(plan.flops.sum()), float(plan.bytes.sum()))
        self.steps.append(rec)
        self.clock_ns = end_cpu
        self.step_index += 1
        return rec

    def drain(self) -> Trace:
        """The events emitted since the last drain, as one Trace (source ``simulated``)."""
        def cat(key, dtype):
            parts = self._buf[key]
            return np.concatenate(parts) if parts else empty(dtype)
        t = Trace(kernels=cat("kernels", KERNEL_DTYPE), copies=cat("copies", COPY_DTYPE), api=cat("api", API_DTYPE),
                  ranges=cat("ranges", RANGE_DTYPE), names=self.names, devices=[self.device],
                  meta=self.meta())
        for v in self._buf.values():
            v.clear()
        self._buf_kernels = 0
        return t

    def meta(self) -> dict:
        return {"source": "simulated", "simulated": True, "generator": "ridgeline simulate",
                "engine": self.cfg.engine, "engine_description": self.conv.description,
                "model": self.model.name, "gpu": self.gpu.name, "ceilings_source": self.gpu.source,
                "seed": self.seed, "kv_pool_blocks": self.pool.total_blocks, "block_size": self.pool.block_size,
                "simplifications": "eager launches (no CUDA graphs); roofline kernel durations at stated "
                                   "efficiencies; recompute preemption; shared prefix never evicted"}

    # ---- the step -----------------------------------------------------------------

    def _admit_arrivals(self) -> None:
        arr = self.requests.arrival_ns
        while self._next_req < len(arr) and arr[self._next_req] <= self.clock_ns:
            i = self._next_req
            self.sched.waiting.append(Request(i, int(arr[i]), int(self.requests.prompt_len[i]),
                                              int(self.requests.output_len[i])))
            self._next_req += 1

    def _abort_head(self) -> None:
        r = self.sched.waiting.popleft()
        self.aborted += 1
        if self.metrics:
            self.metrics.success("abort")
        r.last_token_ns = self.clock_ns

    def _step(self) -> bool:
        now = self.clock_ns
        batch, preempted = self.sched.schedule(now)
        self.preemptions_total += preempted
        if self.metrics and preempted:
            self.metrics.preemptions.inc(preempted)
        if not batch:
            if not self.sched.running and self.sched.waiting:
                self._abort_head()        # larger than the whole pool: the engine rejects it
            else:
                self.clock_ns += self.conv.host_overhead_ns
            return False
        q = np.fromiter((n for _, n in batch), dtype=np.int64, count=len(batch))
        ctx = np.fromiter((r.computed for r, _ in batch), dtype=np.int64, count=len(batch))
        seq = np.fromiter((r.seq_len for r, _ in batch), dtype=np.int64, count=len(batch))
        samples = (ctx + q) >= seq
        shape = StepShape(q, ctx, samples)
        plan = self.planner.plan(shape)
        end_cpu, gpu_start, gpu_end = self._emit(plan, shape, batch)
        # Token bookkeeping at the step's end.
        prefill_tokens = int(q[~((q == 1) & (ctx > 0))].sum())
        decode_tokens = int(shape.tokens - prefill_tokens)
        m = self.metrics
        t_tok = gpu_end + DTOH_COPY_NS
        for (r, n), s in zip(batch, samples.tolist()):
            was_prefill = r.computed < r.prompt
            r.computed += n
            self.sched.register_prefix(r)
            if m and was_prefill:   # prompt tokens computed in this step (recomputes count again)
                m.prompt_tokens.inc(min(n, r.prompt - (r.computed - n)))
            if not s:
                continue
            r.generated += 1
            if m:
                m.generation_tokens.inc()
            if r.first_token_ns < 0:
                r.first_token_ns = t_tok
                if m:
                    m.ttft.observe((t_tok - r.arrival_ns) / 1e9)
            elif m:
                m.itl.observe((t_tok - r.last_token_ns) / 1e9)
            r.last_token_ns = t_tok
            if r.generated >= r.output:
                self.sched.finish(r)
                self.finished.append(r)
                self.finished_total += 1
                if m:
                    m.success("length")
                    m.e2e.observe((t_tok - r.arrival_ns) / 1e9)
                    m.queue_time.observe(max(0, r.scheduled_ns - r.queued_ns) / 1e9)
                    m.prefill_time.observe(max(0, r.first_token_ns - r.scheduled_ns) / 1e9)
                    m.decode_time.observe(max(0, t_tok - r.first_token_ns) / 1e9)
                    m.inference_time.observe(max(0, t_tok - r.scheduled_ns) / 1e9)
        if m:
            m.iteration_tokens.observe(shape.tokens)
            m.prefix_queries.inc(self.sched.prefix_queries_total - self._prefix_seen[0])
            m.prefix_hits.inc(self.sched.prefix_hits_total - self._prefix_seen[1])
            m.prompt_tokens_cached.inc(self.sched.prefix_hits_total - self._prefix_seen[1])
            m.estimated_flops.inc(float(plan.flops.sum()))
            m.estimated_read_bytes.inc(float(plan.bytes.sum()))
            self._prefix_seen = (self.sched.prefix_queries_total, self.sched.prefix_hits_total)
        self.steps.append(StepRecord(now, end_cpu, gpu_start, gpu_end, shape.tokens, prefill_tokens, decode_tokens,
                                     shape.sequences, len(self.sched.running), len(self.sched.waiting),
                                     self.pool.usage_ratio, preempted, len(plan.dur_ns),
                                     float(plan.flops.sum()), float(plan.bytes.sum())))
        self.clock_ns = end_cpu
        self.step_index += 1
        self._update_gauges()
        return True

    def _update_gauges(self) -> None:
        if self.metrics:
            self.metrics.running.set(len(self.sched.running))
            self.metrics.waiting.set(len(self.sched.waiting))
            self.metrics.kv_usage.set(self.pool.usage_ratio)

    def _emit(self, plan, shape: StepShape, batch) -> tuple[int, int, int]:
        cfg, conv = self.cfg, self.conv
        base = cfg.time_base_ns
        n = len(plan.dur_ns)
        L = conv.launch_api_ns
        cpu0 = self.clock_ns + conv.host_overhead_ns
        api_start = cpu0 + np.arange(n, dtype=np.int64) * L
        ready = api_start + L // 2
        ready[0] = max(int(ready[0]), self.gpu_free_ns)
        d = plan.dur_ns
        csum = np.cumsum(d)
        prev = np.concatenate(([0], csum[:-1]))
        end = csum + np.maximum.accumulate(ready - prev)
        start = end - d
        gpu_end = int(end[-1])
        # Device-to-host copy of the sampled ids, then the sync that waits for it.
        memcpy_api0 = int(api_start[-1]) + L
        copy_start = max(gpu_end, memcpy_api0 + MEMCPY_API_NS // 2)
        copy_end = copy_start + DTOH_COPY_NS
        sync0 = memcpy_api0 + MEMCPY_API_NS
        sync_end = max(sync0 + 1_000, copy_end + 1_000)
        end_cpu = sync_end + POSTPROCESS_NS
        self.gpu_free_ns = copy_end

        if not cfg.emit_events:
            return end_cpu, int(start[0]), gpu_end
        if self._buf_kernels + n > cfg.max_buffer_kernels:
            self.dropped_kernels += n          # nobody drains: keep the clock going, count the loss
            return end_cpu, int(start[0]), gpu_end
        corr = self.correlation + np.arange(n + 2, dtype=np.int64)
        self.correlation += n + 2
        ids = np.array([self.names.intern(s) for s in plan.names], dtype=np.int32)[plan.name_idx]

        k = np.zeros(n, dtype=KERNEL_DTYPE)
        k["start_ns"] = start + base
        k["end_ns"] = end + base
        k["device"] = cfg.device
        k["stream"] = COMPUTE_STREAM
        k["context"] = 1
        k["correlation_id"] = corr[:n]
        k["external_id"] = -1
        k["grid_x"], k["grid_y"], k["grid_z"] = plan.grid[:, 0], plan.grid[:, 1], plan.grid[:, 2]
        k["block_x"], k["block_y"], k["block_z"] = plan.block_x, 1, 1
        k["registers"] = 64
        k["shared_mem_bytes"] = 0
        k["name_id"] = ids
        k["graph_id"] = -1
        k["graph_node_id"] = -1
        k["pid"] = cfg.pid
        k["tid"] = cfg.tid

        a = np.zeros(n + 2, dtype=API_DTYPE)
        a["start_ns"][:n] = api_start + base
        a["end_ns"][:n] = api_start + base + (L * 4) // 5
        a["start_ns"][n], a["end_ns"][n] = memcpy_api0 + base, memcpy_api0 + MEMCPY_API_NS + base
        a["start_ns"][n + 1], a["end_ns"][n + 1] = sync0 + base, sync_end + base
        a["pid"] = cfg.pid
        a["tid"] = cfg.tid
        a["correlation_id"] = corr
        a["external_id"] = -1
        a["cbid"][:n] = CBID_LAUNCH_KERNEL
        a["cbid"][n], a["cbid"][n + 1] = CBID_MEMCPY_ASYNC, CBID_STREAM_SYNC
        a["domain"] = API_DOMAIN_RUNTIME
        a["category"][:n] = API_LAUNCH
        a["category"][n], a["category"][n + 1] = API_MEMCPY, API_SYNC
        a["name_id"][:n] = self._api_ids[conv.launch_api]
        a["name_id"][n] = self._api_ids["cudaMemcpyAsync"]
        a["name_id"][n + 1] = self._api_ids["cudaStreamSynchronize"]

        c = np.zeros(1, dtype=COPY_DTYPE)
        c["start_ns"], c["end_ns"] = copy_start + base, copy_end + base
        c["device"], c["stream"], c["correlation_id"] = cfg.device, COMPUTE_STREAM, corr[n]
        c["kind"], c["direction"] = COPY_KIND_MEMCPY, COPY_DTOH
        c["bytes"] = 8 * max(1, shape.sampling)
        c["graph_id"], c["pid"], c["tid"], c["name_id"] = -1, cfg.pid, cfg.tid, -1

        self._buf["kernels"].append(k)
        self._buf["api"].append(a)
        self._buf["copies"].append(c)
        if cfg.annotations:
            self._buf["ranges"].append(self._annotation(shape, batch, self.clock_ns, end_cpu,
                                                        int(start[0]), gpu_end))
        self._buf_kernels += n
        self.emitted_kernels += n
        return end_cpu, int(start[0]), gpu_end

    def _annotation(self, shape: StepShape, batch, cpu0: int, cpu1: int, gpu0: int, gpu1: int) -> np.ndarray:
        """The engine's step annotation (vLLM's detailed ``execute_..._context_..._generation_...``,
        see :func:`vllm_step_label`, or ``ProfilerStep#N``) on the CPU thread and its GPU projection."""
        base = self.cfg.time_base_ns
        if self.conv.annotation == "vllm":
            label = vllm_step_label(shape.q_lens, shape.ctx_lens)
            cpu_kind = RANGE_USER_ANNOTATION
        else:
            label = f"ProfilerStep#{self.step_index}"
            cpu_kind = RANGE_PROFILER_STEP
        nid = self.names.intern(label)
        r = np.zeros(2, dtype=RANGE_DTYPE)
        r["start_ns"] = (cpu0 + base, gpu0 + base)
        r["end_ns"] = (cpu1 + base, gpu1 + base)
        r["pid"] = self.cfg.pid
        r["tid"] = (self.cfg.tid, COMPUTE_STREAM)
        r["device"] = (-1, self.cfg.device)
        r["kind"] = (cpu_kind, RANGE_GPU_ANNOTATION)
        r["name_id"] = nid
        r["external_id"] = -1
        return r

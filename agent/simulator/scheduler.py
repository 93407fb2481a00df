"""Continuous-batching scheduler in the manner of vLLM V1.

Each step has a token budget (``max_num_batched_tokens``) and a batch limit
(``max_num_seqs``). Running requests are served first, in order: a decoding request
takes one token, a prefilling one takes what remains of its prompt (a chunk of it when
``chunked_prefill`` is on and the budget is short). When the KV pool cannot hold a
running request's new tokens, the lowest-priority running request (the last admitted)
is preempted by recompute: its blocks are freed, its computed tokens forgotten, and it
goes back to the front of the queue. Waiting requests are admitted, first come first
served, only in a step without preemption, while the batch limit, the budget and the
pool allow.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kvpool import KvPool


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    max_model_len: int = 32768


class Request:
    __slots__ = ("rid", "arrival_ns", "prompt", "output", "computed", "generated", "blocks",
                 "shared_blocks", "queued_ns", "scheduled_ns", "first_token_ns", "last_token_ns",
                 "preemptions", "prefix_hit", "first_scheduled_ns", "pauses")

    def __init__(self, rid: int, arrival_ns: int, prompt: int, output: int):
        self.rid, self.arrival_ns, self.prompt, self.output = rid, arrival_ns, prompt, output
        self.computed = 0
        self.generated = 0
        self.blocks = 0            # own KV blocks
        self.shared_blocks = 0     # shared-prefix blocks it reads
        self.queued_ns = arrival_ns
        self.scheduled_ns = -1
        self.first_token_ns = -1
        self.last_token_ns = -1
        self.preemptions = 0
        self.prefix_hit = 0
        self.first_scheduled_ns = -1     # scheduled_ns is the last (re)admission
        self.pauses: list[list[int]] = []    # [preempted_ns, resumed_ns (-1: still out)]

    @property
    def seq_len(self) -> int:
        return self.prompt + self.generated


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: KvPool, shared_prefix_tokens: int = 0):
        self.cfg, self.pool = cfg, pool
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.prefix_tokens = shared_prefix_tokens
        self.prefix_ready = False
        self.preemptions_total = 0
        self.prefix_queries_total = 0
        self.prefix_hits_total = 0

    def _need_blocks(self, r: Request, n: int) -> int:
        return self.pool.blocks_for(r.computed + n) - r.shared_blocks - r.blocks

    def _preempt(self, r: Request, now_ns: int) -> None:
        self.pool.free(r.blocks)
        r.blocks = 0
        r.computed = 0
        r.shared_blocks = 0
        r.preemptions += 1
        r.pauses.append([now_ns, -1])
        r.queued_ns = now_ns
        self.preemptions_total += 1
        self.waiting.appendleft(r)

    def _admit_prefix(self, r: Request) -> None:
        """A fresh (or recomputing) request reads the shared prefix from the cache."""
        if r.computed == 0:
            self.prefix_queries_total += r.prompt
            if self.prefix_ready:
                blocks = self.pool.prefix_blocks
                r.shared_blocks = blocks
                r.computed = blocks * self.pool.block_size
                r.prefix_hit = r.computed
                self.prefix_hits_total += r.computed

    def schedule(self, now_ns: int) -> tuple[list[tuple[Request, int]], int]:
        """The requests of the next step with their new tokens, and the preemptions it caused."""
        budget = self.cfg.max_num_batched_tokens
        out: list[tuple[Request, int]] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            need = r.seq_len - r.computed
            if need > budget and not self.cfg.chunked_prefill:
                i += 1
                continue
            n = min(need, budget)
            blocks = self._need_blocks(r, n)
            while blocks > 0 and not self.pool.try_allocate(blocks):
                victim = self.running.pop()
                self._preempt(victim, now_ns)
                preempted += 1
                if victim is r:
                    break
            else:
                r.blocks += max(0, blocks)
                out.append((r, n))
                budget -= n
                i += 1
                continue
            break   # r itself was preempted: nothing after it is left
        if preempted == 0:
            while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
                r = self.waiting[0]
                self._admit_prefix(r)
                need = r.seq_len - r.computed
                if need > budget and not self.cfg.chunked_prefill:
                    break
                n = min(need, budget)
                blocks = self._need_blocks(r, n)
                if not self.pool.try_allocate(blocks):
                    break
                r.blocks += blocks
                self.waiting.popleft()
                self.running.append(r)
                r.scheduled_ns = now_ns
                if r.first_scheduled_ns < 0:
                    r.first_scheduled_ns = now_ns
                if r.pauses and r.pauses[-1][1] < 0:
                    r.pauses[-1][1] = now_ns
                out.append((r, n))
                budget -= n
        return out, preempted

    def register_prefix(self, r: Request) -> None:
        """First request past the shared prefix: its full prefix blocks become the cache's."""
        if self.prefix_ready or not self.prefix_tokens or r.computed < self.prefix_tokens:
            return
        blocks = self.prefix_tokens // self.pool.block_size
        if blocks == 0:
            return
        r.blocks -= blocks
        r.shared_blocks += blocks
        self.pool.used_blocks -= blocks
        self.pool.prefix_blocks = blocks
        self.prefix_ready = True

    def finish(self, r: Request) -> None:
        self.pool.free(r.blocks)
        r.blocks = 0
        self.running.remove(r)

"""One vLLM-like engine core, sans-I/O: the scheduler, the KV blocks and the step cost model.

No clock is read and nothing blocks: every method takes ``now`` (seconds, any epoch) and the caller
(a driver) decides when time passes. The same object runs under the real-time HTTP worker (asyncio,
absolute deadlines) and under the discrete-event drivers (:mod:`simulator.core.virtual`,
:mod:`simulator.core.cluster`).

Driving it (the whole protocol)::

    engine = Engine(load_profile(), EngineConfig())
    engine.add_request(EngineRequest.from_token_ids("r1", prompt_ids, output_ids, max_tokens=64), now)
    while (t := engine.next_step_at()) is not None:
        result = engine.step(max(now, t))      # decides the batch and its duration; state is advanced
        ...wait until result.end (real time) or jump there (virtual time)...
        deliver result.sampled / first_tokens / finished; start result.kv_pulls; now = result.end

- ``step(now)`` schedules one engine iteration starting at ``now`` (≥ the end of the previous step) and
  returns a :class:`StepResult`. Its tokens belong to ``result.end``: deliver them then, all together.
- ``next_step_at()`` is the earliest time ``step`` has work (the end of the running step, or a lease
  expiry while idle), or ``None`` when idle. Call it again after ``add_request``, ``kv_loaded``,
  ``release`` and ``abort``.
- ``step(now, horizon)`` with ``EngineConfig(fast_forward=True)`` may return a *run* of
  ``n_steps > 1`` identical decode-only steps (no prefill, nothing waiting) that all start before
  ``horizon`` and stop at the first finish. Pass the time of the next event that could reach this
  engine. A run lists no ``sampled`` ids; every running request got ``n_steps`` tokens.

P/D roles (vLLM's NixlConnector pull protocol, docs/vllm-protocol.md 1.3-1.6):

- ``remote_decode=True`` (P side): prefill only, one output token, finish reason ``length``; the blocks
  stay pinned (``Finished.kv_pinned``) until ``release(request_id)`` (D read them) or the lease expires
  (``lease_alive`` / ``extend_lease``; expiries are applied at the next ``step`` and counted).
- ``remote_prefill=True`` (D side): when the scheduler reaches it, D looks up its own prefix cache,
  allocates blocks for the prompt and emits a :class:`KvPull` (tokens to move; ``EngineConfig.kv_pull``
  says whether only the uncached tokens move, as vLLM 0.33 does, or the whole prompt, as the paper's
  P2pNccl emulation does). The request waits, out of the batch, until the driver calls
  ``kv_loaded(request_id, now, stall_s)``; then its last prompt token is recomputed in a 1-token chunk,
  which samples the first output token. ``stall_s`` is added to the duration of that step (the paper's
  "blocking on the decode worker" mode). ``kv_failed`` ends it with reason ``error`` (HTTP 500 in vLLM,
  ``kv_load_failure_policy=fail``); ``kv_recompute`` sends it back to the front of the queue to prefill
  its prompt here instead (``kv_load_failure_policy=recompute``: a fresh local lookup, then chunks).
  Its prompt tokens count by source (``stats()``) once the KV arrived, or when recomputed, as vLLM's
  prefill stats do: a pull that fails counts nothing as transferred.

Bidirectional mode (vLLM's ``bidirectional_kv_xfer``, docs/vllm-protocol.md 3.4; off unless a request asks):

- ``kv_ttl_s`` (D side): when the request finishes its blocks, output blocks included, stay pinned for
  that long (``decoder_kv_blocks_ttl``, no heartbeats) so that the next turn's prefill can read them;
  ``release`` / expiry as for a P lease. ``remote_block_ids`` then covers prompt + output.
- ``remote_prefix_tokens`` (P side, with ``remote_decode``): the KV of the first
  ``min(remote_prefix_tokens, n_prompt)`` prompt tokens sits on a decode engine. After its local lookup
  the request pulls what it lacks (a :class:`KvPull`, then ``kv_loaded``) unless that is fewer than
  ``EngineConfig.kv_recompute_threshold`` tokens; then it prefills the rest. Its
  ``Finished.num_cached_tokens`` counts the pulled tokens too (vLLM's ``num_cached_tokens``).

Output length: the text generator decides the natural length (``eos_at``: EOS is the last of that many
tokens); the engine honours ``max_tokens``, ``min_tokens`` (EOS suppressed before it) and ``ignore_eos``.

Scheduler rules (vLLM V1 with chunked prefill):
1. Each step runs every decoding request (1 token), then partial prefills in admission order, then
   admits waiting requests FCFS, all within ``max_num_batched_tokens`` and ``max_num_seqs``.
2. A new request's prefix hit is whole cached blocks, at most ``n_prompt − 1`` tokens.
3. When blocks run out for running requests, the most recently admitted running request is preempted
   (blocks freed, recomputed later from the front of the queue); a waiting request never preempts.
4. Full prompt blocks are cached as they are computed; output blocks are cached when the request ends.
5. Lookup and allocation are atomic: a request that cannot be admitted holds no blocks while it waits.
6. A sequence never outgrows the KV cache: ``add_request`` refuses a prompt that does not fit and the
   output is capped (reason ``length``) where prompt + output would exceed it (vLLM's max_model_len).

Other queries: ``stats()`` (vLLM metric values), ``load()`` (unfinished requests), ``has_request``,
``num_output_tokens``, ``remote_block_ids`` (ids for ``kv_transfer_params``), ``lease_expires_at``,
``expire_leases(now)``, ``pool`` (the :class:`~simulator.core.kv_cache.BlockPool`;
``pool.reset_prefix_cache()``).

Step log (the format both drivers record, compared by tests): ``StepResult.log_entry()`` gives
``{"t": start, "dt": duration, "n": n_steps, "decode": [ids], "prefill": [[id, n_new, n_cached]],
"first": [ids], "finished": [[id, reason, n_out]], "pulls": [[id, n_tokens]], "preempted": [ids]}``
with ids sorted; ``decode`` is empty for fast-forward runs.

Why one module (about 1,100 lines): the scheduler, the P/D lease and pull states and the fast-forward
plan all read and change the same running / waiting queues and block pool within one step, and mypyc
compiles it as one unit (``ppd-sim build-native``); the block pool (``kv_cache``) and the cost model
(``cost``), which need none of that state, are apart.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from simulator.core.cost import CostModel
from simulator.core.kv_cache import BlockContent, BlockPool, StreamBlocks, TokenBlocks
from simulator.core.profile import Profile

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "Finished",
    "KvPull",
    "KvPullMode",
    "PrefillChunk",
    "StepResult",
]


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class KvPullMode(enum.StrEnum):
    UNCACHED = "uncached"  # vLLM 0.33 NIXL: D pulls only the prompt tokens it does not hold
    FULL = "full"  # the paper's P2pNccl emulation: the whole prompt moves every time


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine sees it; ``content`` gives the block hashes of prompt + output."""

    request_id: str
    n_prompt: int
    content: BlockContent
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_at: int | None = None
    remote_decode: bool = False
    remote_prefill: bool = False
    remote_prefix_tokens: int = 0
    kv_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.n_prompt <= 0:
            raise ValueError("a request needs at least one prompt token")
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        if self.remote_decode and self.remote_prefill:
            raise ValueError("a request is either the P leg (remote_decode) or the D leg (remote_prefill)")
        if self.remote_prefix_tokens and not self.remote_decode:
            raise ValueError("only a P leg (remote_decode) pulls a decode engine's blocks")
        if self.kv_ttl_s is not None and (self.remote_decode or self.kv_ttl_s <= 0):
            raise ValueError("kv_ttl_s (> 0) is for requests that are not the P leg")

    @classmethod
    def from_token_ids(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        eos_at: int | None = None,
        remote_decode: bool = False,
        remote_prefill: bool = False,
        block_size: int = 16,
    ) -> EngineRequest:
        """A request over real tokens; ``output_token_ids`` (the planned answer) lets its blocks be cached."""
        content = TokenBlocks([*prompt_token_ids, *output_token_ids], block_size)
        return cls(
            request_id=request_id,
            n_prompt=len(prompt_token_ids),
            content=content,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            eos_at=eos_at,
            remote_decode=remote_decode,
            remote_prefill=remote_prefill,
        )

    @classmethod
    def from_stream(
        cls,
        request_id: str,
        stream_id: int,
        n_prompt: int,
        *,
        max_tokens: int,
        eos_at: int | None = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        remote_decode: bool = False,
        remote_prefill: bool = False,
    ) -> EngineRequest:
        """A request whose prompt is the first ``n_prompt`` tokens of synthetic stream ``stream_id``."""
        return cls(
            request_id=request_id,
            n_prompt=n_prompt,
            content=StreamBlocks(stream_id),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            eos_at=eos_at,
            remote_decode=remote_decode,
            remote_prefill=remote_prefill,
        )

    def output_target(self) -> tuple[int, FinishReason]:
        """How many tokens it will produce and why it stops."""
        if self.remote_decode:
            return 1, FinishReason.LENGTH
        if self.ignore_eos or self.eos_at is None:
            return self.max_tokens, FinishReason.LENGTH
        natural = max(self.eos_at, self.min_tokens, 1)
        if natural <= self.max_tokens:
            return natural, FinishReason.STOP
        return self.max_tokens, FinishReason.LENGTH


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Run-time knobs; ``None`` means the profile's value.

    ``record_sampled=False`` (the cluster simulation) leaves ``StepResult.sampled``, ``decoded`` and
    ``prefills`` empty: only first tokens, finishes, pulls and preemptions are reported.
    ``kv_pull`` defaults to vLLM 0.33's behaviour (pull only what D lacks); the cluster sim uses ``FULL``.
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    kv_capacity_tokens: int | None = None
    block_size: int | None = None  # None: the profile's
    lease_s: float | None = None
    kv_pull: KvPullMode = KvPullMode.UNCACHED
    kv_recompute_threshold: int = 64  # bidirectional pulls of fewer tokens are recomputed instead
    record_sampled: bool = True
    fast_forward: bool = False
    cascade: bool | None = None


class PrefillChunk(NamedTuple):
    request_id: str
    n_new: int
    n_cached: int


class KvPull(NamedTuple):
    """D must receive the KV of ``n_tokens`` prompt tokens, then ``kv_loaded``; ``n_cached`` are local."""

    request_id: str
    n_tokens: int
    n_cached: int


class Finished(NamedTuple):
    request_id: str
    reason: FinishReason
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_pinned: bool = False


@dataclass(slots=True)
class StepResult:
    """What one step (or fast-forward run) did; tokens belong to ``end``. Treat it as read-only."""

    start: float
    duration: float
    n_steps: int = 1
    num_decodes: int = 0
    prefills: tuple[PrefillChunk, ...] = ()
    sampled: tuple[str, ...] = ()
    first_tokens: tuple[str, ...] = ()
    finished: tuple[Finished, ...] = ()
    kv_pulls: tuple[KvPull, ...] = ()
    preempted: tuple[str, ...] = ()
    stall_s: float = 0.0
    decoded: tuple[str, ...] = field(default=(), repr=False)

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def prefill_tokens(self) -> int:
        return sum(c.n_new for c in self.prefills)

    def log_entry(self) -> dict[str, Any]:
        return {
            "t": self.start,
            "dt": self.duration,
            "n": self.n_steps,
            "decode": sorted(self.decoded),
            "prefill": sorted([c.request_id, c.n_new, c.n_cached] for c in self.prefills),
            "first": sorted(self.first_tokens),
            "finished": sorted([f.request_id, str(f.reason), f.num_output_tokens] for f in self.finished),
            "pulls": sorted([p.request_id, p.n_tokens] for p in self.kv_pulls),
            "preempted": sorted(self.preempted),
        }


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What vLLM's /metrics shows for one engine (names in docs/vllm-protocol.md 4.3)."""

    num_running: int
    num_waiting: int
    num_waiting_capacity: int
    num_waiting_deferred: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    external_prefix_cache_queries: int
    external_prefix_cache_hits: int
    num_preemptions: int
    num_pinned: int
    num_kv_expired: int
    prompt_tokens_local_compute: int
    prompt_tokens_local_cache_hit: int
    prompt_tokens_external: int
    num_steps: int


class _S(enum.IntEnum):
    WAITING = 0
    PULLING = 1
    READY = 2
    PREFILL = 3
    DECODE = 4
    PINNED = 5
    DONE = 6


class _Req:
    __slots__ = (
        "base",
        "cached",
        "computed",
        "content",
        "ext_owed",
        "finish_d",
        "hashes",
        "local_only",
        "looked_up",
        "n_prompt",
        "out",
        "prefill_target",
        "private",
        "reason",
        "req",
        "rid",
        "scan",
        "stall",
        "state",
        "target",
    )

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        self.rid = req.request_id
        self.content = req.content
        self.n_prompt = req.n_prompt
        self.target, self.reason = req.output_target()
        self.state = _S.WAITING
        self.computed = 0
        self.prefill_target = req.n_prompt
        self.out = 0
        self.base = 0
        self.finish_d = 0
        self.hashes: list[int] = []
        self.private = 0
        self.scan = 0
        self.cached = 0
        self.looked_up = False
        self.local_only = False  # a failed pull being recomputed: never pull again
        self.stall = 0.0
        # Tokens D computes that vLLM counts as pulled: after a full pull D recomputes the last prompt
        # token for its logits, yet vLLM counts every pulled token as external_kv_transfer.
        self.ext_owed = 0


class Engine:
    """A single vLLM engine core; see the module docstring for the driving protocol and the rules."""

    def __init__(self, profile: Profile, config: EngineConfig | None = None) -> None:
        cfg = config or EngineConfig()
        self.profile = profile
        self.config = cfg
        self.cost = CostModel(profile)
        sched = profile.scheduler
        self._bs = cfg.block_size or sched.block_size
        self._budget = cfg.max_num_batched_tokens or sched.max_num_batched_tokens
        self._max_seqs = cfg.max_num_seqs or sched.max_num_seqs
        if self._budget < self._max_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs")
        capacity = (
            cfg.kv_capacity_tokens if cfg.kv_capacity_tokens is not None else profile.kv_capacity_tokens
        )
        self.pool = BlockPool(max(1, capacity // self._bs))
        self._lease_s = cfg.lease_s if cfg.lease_s is not None else profile.lease_s
        self._cascade = profile.cascade.enabled if cfg.cascade is None else cfg.cascade
        self._rho = profile.cascade.reread_factor
        self._ff = cfg.fast_forward and not self._cascade
        self._record = cfg.record_sampled
        self._kv_full = cfg.kv_pull is KvPullMode.FULL
        self._recompute_below = cfg.kv_recompute_threshold

        self._reqs: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._ready: deque[_Req] = deque()
        self._running: dict[str, _Req] = {}  # PREFILL and DECODE, in admission order
        self._prefilling: dict[str, _Req] = {}
        self._decoding: dict[str, _Req] = {}
        self._pinned: dict[str, tuple[_Req, float]] = {}
        self._lease_heap: list[tuple[float, str]] = []
        # Lazy decode state: a decoding request has out = D − base tokens and context n_prompt + out.
        self._d = 0
        self._dec_heap: list[tuple[int, int, _Req]] = []
        self._seq = 0
        self._ctx_offset = 0  # Σ (n_prompt − base) over decoding requests
        self._residue = [0] * self._bs  # decoding requests by (n_prompt − base − 1) mod block size
        self._decode_base: dict[int, float] = {}  # batch size -> cost of a decode-only step, KV reads aside
        self._planned: tuple[float, tuple[int, float, int]] | None = None  # run_end's plan, until a change

        self._free_at = -math.inf
        self._idle = False  # the last step found nothing to do; wait for an outside change
        self._num_steps = 0
        self._q = self._hits = self._ext_q = self._ext_hits = 0
        self._preemptions = 0
        self._expired = 0
        self._tok_compute = self._tok_hit = self._tok_ext = 0

    # ---------------------------------------------------------------- inputs
    def add_request(self, req: EngineRequest, now: float) -> None:
        """Queue a request (FCFS). Raises ValueError on a duplicate id."""
        del now
        if req.request_id in self._reqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        capacity = self.pool.num_blocks * self._bs
        if req.n_prompt >= capacity:
            raise ValueError(f"prompt of {req.n_prompt} tokens does not fit the KV cache ({capacity} tokens)")
        r = _Req(req)
        if r.target > capacity - r.n_prompt:  # like vLLM's max_model_len: the sequence must fit
            r.target, r.reason = capacity - r.n_prompt, FinishReason.LENGTH
        self._reqs[r.rid] = r
        self._waiting.append(r)
        self._idle = False
        self._planned = None

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request wherever it is (freeing its blocks); False if unknown or already finished."""
        del now
        r = self._reqs.pop(request_id, None)
        if r is None:
            return False
        if r.state is _S.PINNED:
            self._pinned.pop(request_id, None)
        elif r.state is _S.WAITING:
            self._waiting.remove(r)
        elif r.state is _S.READY:
            self._ready.remove(r)
        elif r.state in (_S.PREFILL, _S.DECODE):
            self._unschedule(r)
        self._free_blocks(r, register_outputs=False)
        r.state = _S.DONE
        self._idle = False
        self._planned = None
        return True

    def kv_loaded(self, request_id: str, now: float, stall_s: float = 0.0) -> bool:
        """The KV of a pulled request arrived; ``stall_s`` is charged to the step that admits it."""
        del now
        r = self._reqs.get(request_id)
        if r is None or r.state is not _S.PULLING:
            return False
        loaded = r.n_prompt - 1 if r.req.remote_prefill else min(r.req.remote_prefix_tokens, r.n_prompt - 1)
        self._tok_hit += r.cached
        if r.req.remote_prefill:  # vLLM: num_external_computed_tokens = prompt - locally cached
            self._tok_ext += r.n_prompt - r.cached
            r.ext_owed = r.n_prompt - loaded
        else:
            self._tok_ext += loaded - r.cached
        r.computed = loaded
        if not r.req.remote_prefill:  # a bidirectional P leg: the pulled prefix counts as cached
            r.cached = loaded
        r.stall = stall_s
        self._register_full_blocks(r, r.computed)
        r.state = _S.READY
        self._ready.append(r)
        self._idle = False
        self._planned = None
        return True

    def kv_failed(self, request_id: str, now: float) -> Finished | None:
        """The pull failed (P's lease expired, P gone): the request ends with reason ``error``."""
        del now
        r = self._reqs.get(request_id)
        if r is None or r.state is not _S.PULLING:
            return None
        del self._reqs[request_id]
        self._free_blocks(r, register_outputs=False)
        r.state = _S.DONE
        self._idle = False
        self._planned = None
        return Finished(request_id, FinishReason.ERROR, 0, r.n_prompt, r.cached)

    def kv_recompute(self, request_id: str, now: float) -> bool:
        """The pull failed and the prompt is computed here instead (``kv_load_failure_policy=recompute``).

        Like vLLM's scheduler the request frees its blocks and is scheduled again from the front of
        the queue: a fresh prefix-cache lookup (counted again, as vLLM does), then a local prefill.
        False when the request is not waiting for KV.
        """
        del now
        r = self._reqs.get(request_id)
        if r is None or r.state is not _S.PULLING:
            return False
        self._free_blocks(r, register_outputs=False)
        r.state = _S.WAITING
        r.local_only = True
        r.computed = r.cached = r.scan = 0
        r.looked_up = False
        self._waiting.appendleft(r)
        self._idle = False
        self._planned = None
        return True

    def release(self, request_id: str, now: float) -> bool:
        """D read a pinned request's blocks (or gave up): unpin them (they stay in the prefix cache)."""
        del now
        entry = self._pinned.pop(request_id, None)
        if entry is None:
            return False
        r = entry[0]
        self._reqs.pop(request_id, None)
        self._free_blocks(r, register_outputs=False)
        r.state = _S.DONE
        self._idle = False
        self._planned = None
        return True

    def lease_alive(self, request_id: str, now: float) -> bool:
        entry = self._pinned.get(request_id)
        return entry is not None and entry[1] > now

    def lease_expires_at(self, request_id: str) -> float | None:
        """When a pinned request's blocks are freed unless read first (``None``: not pinned)."""
        entry = self._pinned.get(request_id)
        return None if entry is None else entry[1]

    def extend_lease(self, request_id: str, now: float) -> bool:
        """A heartbeat: the lease of a pinned request runs ``lease_s`` from ``now``."""
        entry = self._pinned.get(request_id)
        if entry is None or entry[1] <= now:
            return False
        expires = now + self._lease_s
        self._pinned[request_id] = (entry[0], expires)
        heapq.heappush(self._lease_heap, (expires, request_id))
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Unpin every request whose lease ended at or before ``now``; returns their ids."""
        heap = self._lease_heap
        out: list[str] = []
        while heap and heap[0][0] <= now:
            expires, rid = heapq.heappop(heap)
            entry = self._pinned.get(rid)
            if entry is None or entry[1] != expires:
                continue
            self.release(rid, now)
            self._expired += 1
            out.append(rid)
        return out

    # ---------------------------------------------------------------- queries
    def next_step_at(self) -> float | None:
        has_work = bool(self._running or self._ready or self._waiting)
        if has_work and not self._idle:
            return self._free_at
        heap, pinned = self._lease_heap, self._pinned
        while heap:  # drop entries of released or extended leases
            expires, rid = heap[0]
            entry = pinned.get(rid)
            if entry is not None and entry[1] == expires:
                return max(self._free_at, expires)
            heapq.heappop(heap)
        return None

    def run_end(self, now: float) -> float | None:
        """When ``step(now)`` would end if it is a fast-forward run and nothing changes first; else None.

        A driver may then defer the step (a discrete-event driver's lazy run): ``step(now, t)`` made at
        the first outside change ``t`` (before calling the method that makes it), or ``step(now)`` at
        the returned time, gives exactly the run that stepping at ``now`` with that horizon gives.
        The plan is kept for that ``step(now)`` until any input method or step is called.
        """
        now = max(now, self._free_at)
        if not self.can_fast_forward() or (self._lease_heap and self._lease_heap[0][0] <= now):
            return None
        plan = self._plan_run(now, math.inf)
        if plan is None:
            return None
        self._planned = (now, plan)
        return now + plan[1]

    def can_fast_forward(self) -> bool:
        """Whether the next ``step`` could be a fast-forward run (so a horizon is worth computing)."""
        return self._ff and bool(self._decoding) and not (self._prefilling or self._waiting or self._ready)

    @property
    def busy_until(self) -> float:
        return self._free_at

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def num_output_tokens(self, request_id: str) -> int:
        r = self._reqs.get(request_id)
        if r is None:
            return 0
        return self._d - r.base if r.state is _S.DECODE else r.out

    def load(self) -> int:
        """Requests this engine holds that are not finished (running, waiting, pulling)."""
        return len(self._reqs) - len(self._pinned)

    def resident_prefix_blocks(self, content: BlockContent, n_prompt: int) -> int:
        """Leading blocks of a ``n_prompt``-token prompt this engine's prefix cache holds now (what a
        request arriving now would hit, rule 2: at most ``n_prompt - 1`` tokens); no side effect."""
        return self.pool.match(content, (n_prompt - 1) // self._bs)

    def running_count(self) -> int:
        """Requests in the running batch (vLLM's ``num_requests_running``), in O(1)."""
        return len(self._running)

    def queue_depth(self) -> int:
        """Requests waiting for a batch slot or KV blocks (not those waiting for a KV pull), in O(1)."""
        return len(self._waiting) + len(self._ready)

    def stats(self) -> EngineStats:
        deferred = sum(1 for r in self._reqs.values() if r.state is _S.PULLING)
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting) + len(self._ready) + deferred,
            num_waiting_capacity=len(self._waiting) + len(self._ready),
            num_waiting_deferred=deferred,
            kv_cache_usage=self.pool.usage(),
            prefix_cache_queries=self._q,
            prefix_cache_hits=self._hits,
            external_prefix_cache_queries=self._ext_q,
            external_prefix_cache_hits=self._ext_hits,
            num_preemptions=self._preemptions,
            num_pinned=len(self._pinned),
            num_kv_expired=self._expired,
            prompt_tokens_local_compute=self._tok_compute,
            prompt_tokens_local_cache_hit=self._tok_hit,
            prompt_tokens_external=self._tok_ext,
            num_steps=self._num_steps,
        )

    def remote_block_ids(self, request_id: str) -> list[int]:
        """Stable small integers standing for a pinned request's blocks (for ``kv_transfer_params``):
        its computed tokens, i.e. the prompt, plus the output but its last token on a decode engine."""
        r = self._reqs.get(request_id)
        if r is None:
            return []
        n = -(-max(r.computed, r.n_prompt + r.out - 1) // self._bs)
        return [abs(r.content.block_hash(i)) % self.pool.num_blocks for i in range(n)]

    def set_cost(self, cost: CostModel) -> None:
        """Price the steps from here on with ``cost`` (a drift event: the worker got slower or faster).

        Call it between steps: a driver first settles a deferred run, so the step in flight ends as
        planned and the next one is priced anew."""
        self.cost = cost
        self._decode_base.clear()
        self._planned = None

    # ---------------------------------------------------------------- the step
    def step(self, now: float, horizon: float = math.inf) -> StepResult:
        """Schedule and account one engine iteration (or a fast-forward run) starting at ``now``."""
        now = max(now, self._free_at)
        if self._lease_heap and self._lease_heap[0][0] <= now:
            self.expire_leases(now)
        if (
            self._ff
            and self._decoding
            and not self._prefilling
            and not self._waiting
            and not self._ready
            and horizon > now
        ):
            run = self._fast_forward(now, horizon)
            if run is not None:
                return run
        return self._single_step(now)

    def _single_step(self, now: float) -> StepResult:
        self._planned = None
        preempted: list[str] = []
        chunks, left = self._reserve_running(preempted)
        pulls: list[KvPull] = []
        stall = self._admit(chunks, left, pulls)
        num_dec = len(self._decoding)
        if not chunks and not num_dec:
            # Nothing runnable until an outside change (a KV arrival, a new request, freed blocks).
            self._idle = not self._ready
            return StepResult(start=now, duration=0.0, kv_pulls=tuple(pulls), preempted=tuple(preempted))
        self._idle = False
        pairs: list[tuple[int, int]] = []
        sampled_pf = 0
        for r, n in chunks:
            pairs.append((n, r.computed))
            if r.computed + n >= r.prefill_target:
                sampled_pf += 1
        dt = stall + self.cost.step(
            num_decodes=num_dec,
            chunks=pairs,
            num_sampled=num_dec + sampled_pf,
            kv_read_tokens=self._kv_read(),
        )
        decoded: tuple[str, ...] = tuple(self._decoding) if self._record else ()
        prefills = tuple(PrefillChunk(r.rid, n, r.computed) for r, n in chunks) if self._record else ()
        finished: list[Finished] = []
        first: list[str] = []
        sampled: list[str] = list(decoded)
        if num_dec:
            self._d += 1
            self._pop_decode_finishes(finished, now + dt)
        self._apply_chunks(chunks, now + dt, finished, first, sampled)
        self._num_steps += 1
        self._free_at = now + dt
        return StepResult(
            start=now,
            duration=dt,
            num_decodes=num_dec,
            prefills=prefills,
            sampled=tuple(sampled),
            first_tokens=tuple(first),
            finished=tuple(finished),
            kv_pulls=tuple(pulls),
            preempted=tuple(preempted),
            stall_s=stall,
            decoded=decoded,
        )

    def _chunk_blocks(self, r: _Req, n: int) -> int:
        """Blocks ``r`` must add to hold ``n`` more computed tokens."""
        return max(0, -(-(r.computed + n) // self._bs) - (len(r.hashes) + r.private))

    def _reserve_running(self, preempted: list[str]) -> tuple[list[tuple[_Req, int]], int]:
        """Blocks for the running decodes (1 token each) and partial prefills (rule 3: preempt the tail)."""
        while True:
            need = self._residue[(-self._d) % self._bs] if self._decoding else 0
            chunks: list[tuple[_Req, int]] = []
            left = self._budget - len(self._decoding)
            for r in self._prefilling.values():
                if left <= 0:
                    break
                n = min(r.prefill_target - r.computed, left)
                need += self._chunk_blocks(r, n)
                chunks.append((r, n))
                left -= n
            if self.pool.allocate(need) or not self._running:
                break
            victim = self._running[next(reversed(self._running))]
            self._preempt(victim)
            preempted.append(victim.rid)
        for r, n in chunks:
            r.private += self._chunk_blocks(r, n)
        return chunks, left

    def _admit(self, chunks: list[tuple[_Req, int]], left: int, pulls: list[KvPull]) -> float:
        """Admit pulled requests whose KV arrived, then the waiting queue (FCFS); returns their stall."""
        stall = 0.0
        while self._ready and left > 0 and len(self._running) < self._max_seqs:
            r = self._ready.popleft()
            n = min(r.prefill_target - r.computed, left)
            self._to_prefill(r)
            chunks.append((r, n))
            left -= n
            stall += r.stall
            r.stall = 0.0
        while self._waiting and len(self._running) < self._max_seqs:
            r = self._waiting[0]
            if not r.looked_up:
                self._lookup(r)
            if (
                (r.req.remote_prefill or (r.req.remote_prefix_tokens and self._worth_pulling(r)))
                and not r.local_only
                and r.out == 0
                and r.computed == r.cached
                and r.state is _S.WAITING
            ):
                pull = self._start_pull(r)
                if pull is None:
                    self._undo_lookup(r)
                    break  # no room for its blocks yet
                self._count_admission(r, by_source=pull.n_tokens == 0)  # else once the KV is in
                self._waiting.popleft()
                if pull.n_tokens > 0:
                    pulls.append(pull)
                else:  # everything but the last token is cached here: a local prefill next step
                    r.state = _S.READY
                    self._ready.append(r)
                continue
            if left <= 0:
                self._undo_lookup(r)
                break
            n = min(r.prefill_target - r.computed, left)
            extra = self._chunk_blocks(r, n)
            if not self.pool.allocate(extra):
                self._undo_lookup(r)
                break
            r.private += extra
            self._count_admission(r)
            self._waiting.popleft()
            self._to_prefill(r)
            chunks.append((r, n))
            left -= n
        return stall

    def _to_prefill(self, r: _Req) -> None:
        r.state = _S.PREFILL
        self._running[r.rid] = r
        self._prefilling[r.rid] = r

    def _apply_chunks(
        self,
        chunks: list[tuple[_Req, int]],
        end: float,
        finished: list[Finished],
        first: list[str],
        sampled: list[str],
    ) -> None:
        for r, n in chunks:
            if r.ext_owed:
                owed = min(n, r.ext_owed)
                r.ext_owed -= owed
                self._tok_compute += n - owed
            else:
                self._tok_compute += n
            r.computed += n
            self._register_full_blocks(r, r.computed)
            if r.computed < r.prefill_target:
                continue
            r.out += 1
            if self._record:
                sampled.append(r.rid)
            if r.out == 1:
                first.append(r.rid)
            del self._prefilling[r.rid]
            if r.out >= r.target:
                del self._running[r.rid]
                finished.append(self._finish(r, end))
            else:
                self._start_decode(r)

    def _fast_forward(self, now: float, horizon: float) -> StepResult | None:
        planned = self._planned
        self._planned = None
        if planned is not None and planned[0] == now and horizon == math.inf:
            plan: tuple[int, float, int] | None = planned[1]
        else:
            plan = self._plan_run(now, horizon)
        if plan is None:
            return None
        k, duration, need = plan
        if not self.pool.allocate(need):  # _plan_run checked can_allocate; inputs clear the plan
            raise RuntimeError(f"fast-forward of {k} steps planned {need} blocks the pool does not have")
        b = len(self._decoding)
        self._d += k
        finished: list[Finished] = []
        self._pop_decode_finishes(finished, now + duration)
        self._num_steps += k
        self._free_at = now + duration
        self._idle = False
        return StepResult(start=now, duration=duration, n_steps=k, num_decodes=b, finished=tuple(finished))

    def _plan_run(self, now: float, horizon: float) -> tuple[int, float, int] | None:
        """(steps, duration, new blocks) of the fast-forward run starting at ``now``, or None if none.

        Changes nothing but dropping stale entries of the decode heap, so ``run_end`` may ask too.
        """
        b = len(self._decoding)
        heap = self._dec_heap
        while heap and (heap[0][2].state is not _S.DECODE or heap[0][2].finish_d != heap[0][0]):
            heapq.heappop(heap)
        k_finish = heap[0][0] - self._d if heap else 1
        if k_finish <= 1:
            return None
        coef = self.cost.kv_read_s_per_token
        c0 = self._ctx_offset + b * self._d
        base = self._decode_base.get(b)
        if base is None:
            base = self._decode_base[b] = self.cost.decode_only(b, 0.0)
        a = base + coef * c0  # first step
        inc = coef * b  # each step reads b more tokens
        # Steps j = 0..k-1 start at now + a·j + inc·j(j−1)/2; keep those starting before the horizon.
        rem = horizon - now
        if math.isinf(rem):
            k = k_finish
        else:
            if inc > 0:
                qa, qb = inc / 2.0, a - inc / 2.0
                j = int((-qb + math.sqrt(qb * qb + 4 * qa * rem)) / (2 * qa))
            else:
                j = int(rem / a)
            j = max(0, min(j, k_finish))
            while j > 0 and a * j + inc * j * (j - 1) / 2.0 >= rem:
                j -= 1
            while j + 1 < k_finish and a * (j + 1) + inc * (j + 1) * j / 2.0 < rem:
                j += 1
            k = min(k_finish, j + 1)
        if k <= 1:
            return None
        need = self._blocks_for_run(k)
        if not self.pool.can_allocate(need):
            return None
        return k, a * k + inc * k * (k - 1) / 2.0, need

    # ---------------------------------------------------------------- helpers
    def _blocks_for_run(self, k: int) -> int:
        """New blocks the decoding requests need over the next ``k`` steps (see ``_residue``)."""
        bs = self._bs
        full, part = divmod(k, bs)
        need = full * len(self._decoding)
        if part:
            # Steps j = 0..part-1 need res[(-(d + j)) % bs]: a run of indices going down from s0.
            res = self._residue
            s0 = (-self._d) % bs
            lo = s0 - part + 1
            if lo >= 0:
                need += sum(res[lo : s0 + 1])
            else:
                need += sum(res[: s0 + 1]) + sum(res[bs + lo :])
        return need

    def _kv_read(self) -> float:
        if not self._decoding:
            return 0.0
        total = self._ctx_offset + len(self._decoding) * self._d
        if not self._cascade:
            return float(total)
        return self._cascade_kv_read(total)

    def _cascade_kv_read(self, total: int) -> float:
        """KV tokens read by decode attention with vLLM's cascade rule (docs/emulator-model.md 3.3)."""
        bs = self._bs
        casc = self.profile.cascade
        pool = self.pool
        n_running = len(self._running)
        any_req = next(iter(self._running.values()))
        common = 0
        for h in any_req.hashes:
            if pool.ref_count(h) != n_running:
                break
            common += 1
        prefix = common * bs
        if prefix >= casc.min_prefix_tokens and len(self._decoding) >= casc.min_requests:
            return float(prefix + (total - prefix * len(self._decoding)))
        shared = 0
        for r in self._decoding.values():
            # Ref counts never grow along a chain (a holder of block i+1 holds block i): bisect.
            hashes = r.hashes
            lo, hi = 0, len(hashes)
            while lo < hi:
                mid = (lo + hi) // 2
                if pool.ref_count(hashes[mid]) > 1:
                    lo = mid + 1
                else:
                    hi = mid
            shared += lo * bs
        return total - shared + self._rho * shared

    def _lookup(self, r: _Req) -> None:
        r.looked_up = True
        max_blocks = (r.prefill_target - 1) // self._bs
        hashes = self.pool.acquire_prefix(r.content, max_blocks)
        hit = len(hashes)
        if hit:
            r.hashes = hashes
        r.scan = hit
        r.computed = hit * self._bs
        if r.out == 0:
            r.cached = r.computed

    def _undo_lookup(self, r: _Req) -> None:
        """The request could not be admitted: it must not hold cached blocks while it waits."""
        self.pool.release(r.hashes)
        r.hashes = []
        r.scan = 0
        r.computed = 0
        r.looked_up = False

    def _count_admission(self, r: _Req, *, by_source: bool = True) -> None:
        if r.out == 0:  # a new, non-preempted request (vLLM's prefix-cache query rule)
            self._q += r.n_prompt
            self._hits += r.computed
            if by_source:
                self._tok_hit += r.computed

    def _worth_pulling(self, r: _Req) -> bool:
        """A bidirectional P leg: vLLM pulls ``min(remote, n_prompt) − cached`` tokens unless that is
        below the recompute threshold; pulling must also leave fewer tokens to compute here."""
        end = min(r.req.remote_prefix_tokens, r.n_prompt)
        count = end - r.computed
        if min(end, r.n_prompt - 1) <= r.computed:
            return False
        return count >= self._recompute_below

    def _start_pull(self, r: _Req) -> KvPull | None:
        bs = self._bs
        need = -(-r.n_prompt // bs) - len(r.hashes)
        if not self.pool.allocate(need):
            return None
        r.private += need
        if r.cached >= r.n_prompt - 1:
            return KvPull(r.rid, 0, r.cached)
        end = r.n_prompt if r.req.remote_prefill else min(r.req.remote_prefix_tokens, r.n_prompt)
        n = end if self._kv_full else end - r.cached
        loaded = min(end, r.n_prompt - 1) - r.cached
        r.state = _S.PULLING
        self._ext_q += end - r.cached
        self._ext_hits += loaded
        return KvPull(r.rid, n, r.cached)

    def _register_full_blocks(self, r: _Req, n_tokens: int) -> None:
        full = n_tokens // self._bs
        if r.scan >= full:
            return
        start = r.scan
        hashes = r.content.block_hashes(start, full)
        r.scan = full
        if r.private > 0:
            new = self.pool.register_many(hashes, r.private)
            r.hashes.extend(new)
            r.private -= len(new)
            sink = self.pool.sink
            if sink is not None:  # vLLM announces every newly full block of the request
                sink.stored(r.content, start, full)

    def _start_decode(self, r: _Req) -> None:
        r.state = _S.DECODE
        r.base = self._d - r.out
        r.finish_d = r.base + r.target
        self._decoding[r.rid] = r
        self._ctx_offset += r.n_prompt - r.base
        self._residue[(r.n_prompt - r.base - 1) % self._bs] += 1
        self._seq += 1
        heapq.heappush(self._dec_heap, (r.finish_d, self._seq, r))

    def _stop_decode(self, r: _Req) -> None:
        r.out = self._d - r.base
        del self._decoding[r.rid]
        self._ctx_offset -= r.n_prompt - r.base
        self._residue[(r.n_prompt - r.base - 1) % self._bs] -= 1
        # Private blocks held: ceil((n_prompt + out − 1) / bs) in total.
        r.private = -(-(r.n_prompt + r.out - 1) // self._bs) - len(r.hashes)

    def _pop_decode_finishes(self, finished: list[Finished], end: float) -> None:
        heap = self._dec_heap
        d = self._d
        while heap and heap[0][0] <= d:
            fd, _, r = heapq.heappop(heap)
            if r.state is not _S.DECODE or r.finish_d != fd:
                continue
            self._stop_decode(r)
            del self._running[r.rid]
            finished.append(self._finish(r, end))

    def _unschedule(self, r: _Req) -> None:
        if r.state is _S.DECODE:
            self._stop_decode(r)
        else:
            self._prefilling.pop(r.rid, None)
        self._running.pop(r.rid, None)

    def _preempt(self, r: _Req) -> None:
        self._unschedule(r)
        self._free_blocks(r, register_outputs=False)
        self._preemptions += 1
        r.state = _S.WAITING
        r.computed = 0
        r.scan = 0
        r.looked_up = False
        r.prefill_target = r.n_prompt + r.out
        self._waiting.appendleft(r)

    def _finish(self, r: _Req, end: float) -> Finished:
        if r.req.remote_decode or r.req.kv_ttl_s is not None:
            hold = self._lease_s
            if r.req.kv_ttl_s is not None:  # bidirectional D side: its output blocks are read too
                self._register_full_blocks(r, r.n_prompt + r.out - 1)
                hold = r.req.kv_ttl_s
            r.state = _S.PINNED
            expires = end + hold
            self._pinned[r.rid] = (r, expires)
            heapq.heappush(self._lease_heap, (expires, r.rid))
            return Finished(r.rid, r.reason, r.out, r.n_prompt, r.cached, kv_pinned=True)
        del self._reqs[r.rid]
        self._free_blocks(r, register_outputs=True)
        r.state = _S.DONE
        return Finished(r.rid, r.reason, r.out, r.n_prompt, r.cached)

    def _free_blocks(self, r: _Req, *, register_outputs: bool) -> None:
        if register_outputs:
            self._register_full_blocks(r, r.n_prompt + r.out - 1)
        self.pool.release(r.hashes)
        self.pool.release_private(r.private)
        r.hashes = []
        r.private = 0

"""A P/D cluster in virtual time: arrivals -> routing -> P/D engines and KV links -> benchmark records.

Everything is one discrete-event loop over a heap; no clock, no sockets. Engines are the same
:class:`~simulator.core.engine.Engine` the HTTP workers run, in fast-forward mode.

Paths of one request (turn *k* of a conversation, prompt = the ``n_ctx`` tokens before it + ``n_in``):

- ``pd``: after the proxy overhead ``o_PD`` it reaches a prefill engine (``remote_decode``: prefill,
  one token, blocks pinned); at P's finish it goes to the session's decode engine (``remote_prefill``),
  whose scheduler issues the KV pull on the P->D link; when the bytes arrive D recomputes the last
  prompt token and decodes. P's blocks are released when D has them.
- ``local``: after ``o_local`` it goes straight to the session's decode engine, whose prefix cache
  holds the earlier turns (append-prefill).
- ``replica``: every worker does everything; session-affine, like ``local`` without P.
- ``bidir`` (vLLM's bidirectional mode, docs/vllm-protocol.md 3.4; mode ``bidir``, turns 2+): in that
  mode every D leg keeps its blocks pinned for ``decoder_kv_blocks_ttl_s`` when it finishes. The next
  turn's P leg (``remote_prefix_tokens`` = the previous turn's prompt + output - 1) pulls the history
  it does not hold from the session's D over the D->P direction of the pair's link (a link of its own:
  the fabric is full duplex), computes only the rest, and then D pulls the result back as on ``pd``.
  The read releases D's pin; a P that pulls nothing (below ``kv_recompute_threshold``) releases it when
  it finishes, as vLLM's notification does. A pin found expired fails the request
  (``kv_lease_expired``); the gateway would retry it as full PD.

Routing: turn 1 takes ``pd`` (``replica`` in replica mode) on the least-loaded P and D, and the
conversation keeps that D. Turns 2+ follow the mode: ``pd``, ``local``, ``bidir``, ``fraction:<x>`` (a fixed
share of conversations, chosen by a hash of the conversation id), ``ppd`` (a :class:`LocalPolicy`,
normally :class:`simulator.core.routing.TableRouter`: the decision service's pure rule over a table).
With ``ClusterConfig.ppd_bidir`` (``ppd`` mode; a gateway with ``[routing] bidir``) the query says the
caller can serve BIDIR when the conversation's last D leg pinned its blocks (its turn went through P),
the D legs pin as in ``bidir`` mode, and a BIDIR verdict takes the ``bidir`` path (three-way PPD; no
exploration then).
With ``ClusterConfig.explore`` (``ppd`` mode), the gateway's exploration policy (``ppd/explore.py``)
may send a Turn 2+ request down the path the table did not choose, within the same bounds (the
verdict's ``alternative_allowed``; the decode-load guard, a ``LIVE_SIGNAL`` verdict; the cap per
decode worker, in virtual time); its record then carries ``explored`` and ``propensity`` as the
gateway's request log does (left out at their defaults: ε = 0 gives the records of no exploration).
KV blocks: each conversation is one synthetic stream (``kv_cache.StreamBlocks``), the same object for
all its turns, so a turn's prompt hits the blocks of the earlier turns wherever they are still cached.
A shared-prefix conversation (``Conversation.prefix``) puts its group's prompt stream in front for the
prompt's full blocks (``kv_cache.PrefixedBlocks``): the conversations of one (workload, group) share
those blocks in every engine's prefix cache, as vLLM's share a common system prompt.

With ``ClusterConfig.admission`` (enabled), the gateway's admission control (``ppd/admission.py``)
runs in front of routing, in virtual time: a conversation's workload name is its tenant (its class
and weight from the settings' tenants), the in-flight bound counts requests from admission to their
end, a queued request is routed when admitted, and a shed one ends its conversation with the record
``error="shed_<reason>"`` (no TTFT). Its client timeout counts from arrival, queued or not.
A request not finished ``timeout_s`` after it was sent fails (``error="timeout"``), is aborted on
its engines, and ends its conversation.

Drift (``ClusterConfig.drift``, values in :mod:`simulator.core.drift`): each event is one heap event at
its time; the links move to the new bandwidth, and each worker's lazy run is settled there before its
engine gets the new step cost. Without drift events nothing is pushed, so the records are the same
bytes as without the feature. An ``observer`` (:class:`RecordObserver`) sees each request's record
when it finishes, in virtual time: a closed loop refreshes its table from them and swaps it into the
router (``TableRouter.use_table``) for the requests that arrive after.

Lazy runs (why results equal a step-by-step run): when an engine's next step would be a run of
identical decode-only steps (``Engine.run_end``), the node does not step yet; it waits for the run's
end. Every call that changes an engine (a new request, KV arrived or failed, release, abort) first
*settles* a waiting run at that time ``t``: ``Engine.step(start, t)`` makes just the steps that start
before ``t``, the step in flight at ``t`` ends as planned, and the change joins the step after it,
as it would step by step. So a run is cut only where something actually reaches its engine.

Why one module (about 870 lines): the nodes, the event heap, the routing of each turn and the lazy-run
settling share one loop's state (every event may settle any node's run), and mypyc compiles it as one
unit; the engines, links, workload and routing rule it drives are modules of their own.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from decision_service.header import Weights
from decision_service.route import Query, Reason, Verdict
from ppd.admission import AdmissionQueue, AdmissionSettings, Admitted, Queued, Shed
from ppd.explore import ExplorationPolicy, ExploreSettings
from ppd.modes import fraction_goes_local, parse_mode
from ppd.placement import LEAST_LOADED, Candidate, PlacementSettings, place
from ppd.slo import SloController, SloSettings, SloState
from simulator.core.cost import CostModel
from simulator.core.drift import DriftEvent, slowed
from simulator.core.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    EngineStats,
    FinishReason,
    KvPullMode,
    StepResult,
)
from simulator.core.kv_cache import BlockContent, PrefixedBlocks, StreamBlocks
from simulator.core.link import Link, TransferMode
from simulator.core.profile import Profile
from simulator.core.topology import Topology
from simulator.core.workload import Conversation

__all__ = [
    "ClusterConfig",
    "ClusterResult",
    "LocalPolicy",
    "RecordObserver",
    "simulate",
]


class LocalPolicy(Protocol):
    """Per-request choice for turns 2+: True = local (append-prefill on the session's D)."""

    def local(self, conversation_id: str, query: Query) -> bool:
        """``query`` is psi with the live signals a gateway scrapes: the session's D's running batch
        (``decode_running``) and the queue of the P a PD turn would take (``prefill_queue_depth``)."""
        ...


class RecordObserver(Protocol):
    """Sees each request's record (the ``build_records`` dict) at the virtual time it finished or failed."""

    def finished(self, record: dict[str, Any], now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    topology: Topology
    mode: str
    link: str = "nvlink"
    transfer_mode: TransferMode = TransferMode.SHARED_LINK
    kv_pull: KvPullMode = KvPullMode.FULL
    timeout_s: float = 30.0
    think_time_s: float = 0.0
    target_qps: float = 0.0
    run_id: str = "sim"
    model: str = "llama-3.1-8b"
    apply_overheads: bool = True
    fast_forward: bool = True
    kv_capacity_tokens: int | None = None  # per engine; None = the profile's
    # ppd mode: explore the path the table did not choose (ppd/explore.py); needs a router with
    # ``verdict`` (simulator.core.routing.TableRouter).
    explore: ExploreSettings | None = None
    # ppd mode: one SLO controller (ppd/slo.py) fed by finished requests steers the router's w_tpot,
    # starting from its `base_weights` (TableRouter's; a router without them is refused). Other
    # modes: unused.
    slo: SloSettings | None = None
    drift: tuple[DriftEvent, ...] = ()  # timed changes of links and workers (simulator.core.drift)
    # bidir mode: how long a finished D leg keeps its blocks for the next turn (vLLM decoder_kv_blocks_ttl)
    decoder_kv_blocks_ttl_s: float = 480.0
    # ppd mode: the router may answer BIDIR (decision_service.route rule 7), served as in bidir mode.
    ppd_bidir: bool = False
    # Which P a leg through P takes, and the D of Turn 1 (ppd/placement.py, the gateway's rule): by
    # the prompt's prefix resident in each engine's prefix cache against its outstanding requests.
    # least_loaded (the default) is the choice before placement existed: the same records as before.
    placement: PlacementSettings = LEAST_LOADED
    # Admission control in front of routing (ppd/admission.py); tenant = the conversation's workload.
    admission: AdmissionSettings | None = None


@dataclass(slots=True)
class ClusterResult:
    records: list[dict[str, Any]]
    end_time: float
    engine_steps: int
    events: int
    engine_stats: dict[str, EngineStats]
    kv_free_blocks: dict[str, tuple[int, int]]  # engine -> (free, total) at the end
    # With ClusterConfig.slo in ppd mode: (time, the controller's state) at each change of w_tpot.
    slo_trace: list[tuple[float, SloState]] = field(default_factory=list)
    # Request id -> prompt tokens its P leg found in P's prefix cache (legs through P that finished).
    prefill_cached: dict[str, int] = field(default_factory=dict)
    # Request id -> the P whose prefix the placement chose over the least loaded (ppd/placement.py).
    placed_by_prefix: dict[str, str] = field(default_factory=dict)
    # Engine -> virtual seconds it spent stepping (its steps' durations summed): its utilisation is
    # this over the time it was measured (the placement report's "P busy").
    busy_s: dict[str, float] = field(default_factory=dict)


_ARRIVE, _DISPATCH, _STEP, _WAKE, _XFER, _TIMEOUT, _RUN, _DRIFT, _ADMIT = range(9)


class _Node:
    __slots__ = (
        "busy_s",
        "engine",
        "inflight",
        "is_prefill",
        "lazy_from",
        "name",
        "outstanding",
        "run_version",
        "wake_at",
        "wake_version",
    )

    def __init__(self, name: str, engine: Engine, *, is_prefill: bool) -> None:
        self.name = name
        self.engine = engine
        self.is_prefill = is_prefill
        self.inflight: StepResult | None = None
        self.lazy_from: float | None = None  # start of a run not stepped yet (see "Lazy runs")
        self.run_version = 0
        self.outstanding = 0
        self.wake_version = 0
        self.wake_at = math.inf  # time of the pending wake-up, if any
        self.busy_s = 0.0  # seconds of the steps it made (ClusterResult.busy_s)


class _LinkState:
    __slots__ = ("link", "owners", "reverse", "version")

    def __init__(self, link: Link, *, reverse: bool = False) -> None:
        self.link = link
        self.version = 0
        self.owners: dict[int, _Req] = {}
        self.reverse = reverse  # D->P: a bidirectional P leg reading the session's D


class _Blocks:
    """The KV blocks of each conversation of one run (the cluster's block content)."""

    __slots__ = ("_block_size", "_prefix_streams")

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        # Shared-prefix conversations: (workload, group) -> the stream of the group's prompt.
        self._prefix_streams: dict[tuple[str, int], int] = {}

    def of(self, conv: Conversation, n: int) -> BlockContent:
        """The blocks of the ``n``-th conversation: its own stream, behind its group's shared prompt
        when it has one (the prompt's full blocks are the same for the whole group)."""
        own = StreamBlocks(n)
        prefix = conv.prefix
        if prefix is None:
            return own
        key = (conv.workload, prefix.group)
        stream = self._prefix_streams.get(key)
        if stream is None:
            # Negative ids: StreamBlocks' hashes of -2, -3, ... never meet a conversation's (n >= 0).
            stream = self._prefix_streams[key] = -2 - len(self._prefix_streams)
        return PrefixedBlocks(StreamBlocks(stream), prefix.n_tokens // self._block_size, own)


class _Req:
    __slots__ = (
        "admitted",
        "arrival",
        "content",
        "conv",
        "d",
        "deadline",
        "done",
        "error",
        "explored",
        "finish",
        "first",
        "idx",
        "n_ctx",
        "n_in",
        "n_out",
        "p",
        "p_done",
        "path",
        "propensity",
        "rid",
        "transfer",
    )

    def __init__(
        self, conv: Conversation, idx: int, content: BlockContent, arrival: float, n_ctx: int
    ) -> None:
        self.conv = conv
        self.idx = idx
        self.content = content  # the conversation's KV blocks, the same object for all its turns
        self.arrival = arrival
        self.deadline = math.inf
        turn = conv.turns[idx]
        self.n_in = turn.n_in
        self.n_out = turn.n_out
        self.n_ctx = n_ctx
        self.rid = f"{conv.conversation_id}#{idx + 1}"
        self.path = "pd"
        self.p: _Node | None = None
        self.p_done = False
        self.d: _Node | None = None
        self.first: float | None = None
        self.finish: float | None = None
        self.done = False
        self.error: str | None = None
        self.transfer: tuple[_LinkState, int] | None = None
        self.explored = False
        self.propensity = 1.0
        self.admitted = False  # holds one of admission control's in-flight places


class _Sim:
    def __init__(
        self,
        profile: Profile,
        config: ClusterConfig,
        router: LocalPolicy | None,
        observer: RecordObserver | None = None,
    ) -> None:
        self.profile = profile
        self.cfg = config
        self.observer = observer
        mode = parse_mode(config.mode)
        self.kind, self.fraction = mode.kind, mode.fraction
        if self.kind == "ppd" and router is None:
            raise ValueError("mode ppd needs a router")
        self.router = router
        self._set_up_steering(config, router)
        ecfg = EngineConfig(
            kv_pull=config.kv_pull,
            record_sampled=False,
            fast_forward=config.fast_forward,
            kv_capacity_tokens=config.kv_capacity_tokens,
        )
        self._make_nodes(profile, config, ecfg)
        physical = profile.link("nvlink") if config.transfer_mode is TransferMode.BLOCKING_ON_DECODE else None
        spec = profile.link(config.link)
        self.links: dict[tuple[int, int], _LinkState] = {}
        self.reverse_links: dict[tuple[int, int], _LinkState] = {}
        for pi in range(len(self.prefills)):
            for di in range(len(self.decodes)):
                ls = _LinkState(Link(spec, config.transfer_mode, physical))
                self.links[(pi, di)] = ls
                if self.pins:
                    self.reverse_links[(pi, di)] = _LinkState(
                        Link(spec, config.transfer_mode, physical), reverse=True
                    )
        self.d_ttl = config.decoder_kv_blocks_ttl_s if self.pins else None
        self.blocks = _Blocks(profile.scheduler.block_size)
        # Conversations whose last D leg pinned its blocks (three-way ppd may send the next turn bidir).
        self.pinned: set[str] = set()
        ov = profile.overheads
        self.o_pd = ov.pd_s if config.apply_overheads else 0.0
        self.o_local = ov.local_s if config.apply_overheads else 0.0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = itertools.count(1)  # ties in time go in push order
        # Requests by deadline (= arrival order, as the timeout is fixed); one _TIMEOUT event, at the
        # head's deadline, stands for all of them (finished ones are skipped when it fires).
        self.deadlines: deque[_Req] = deque()
        self.records: list[_Req] = []
        self._live: dict[str, _Req] = {}
        self.sessions: dict[str, _Node] = {}
        self.events = self.steps = 0
        self.now = 0.0
        self.prefill_cached: dict[str, int] = {}  # ClusterResult.prefill_cached
        self.placed_by_prefix: dict[str, str] = {}
        self._set_up_admission(config.admission)
        for event in config.drift:  # pushed before the arrivals: at a tie in time, the drift comes first
            self.push(event.at_s, _DRIFT, event)

    def _make_nodes(self, profile: Profile, config: ClusterConfig, ecfg: EngineConfig) -> None:
        """The workers of the topology: P and D nodes, or replicas (mode replica or an R topology)."""
        topo = config.topology
        if topo.replica and (topo.prefill or topo.decode):
            raise ValueError(f"bad topology {topo.name!r}: replica workers do not mix with P/D workers")
        self.replica_mode = self.kind == "replica" or topo.replica > 0
        if topo.replica and self.kind not in ("replica",):
            raise ValueError("a replica topology runs only in mode replica")
        self.prefills: list[_Node] = []
        self.decodes: list[_Node] = []
        if topo.replica:
            self.decodes = [
                _Node(f"R{i}", Engine(profile, ecfg), is_prefill=False) for i in range(topo.replica)
            ]
        elif self.replica_mode:
            n = topo.prefill + topo.decode
            self.decodes = [_Node(f"R{i}", Engine(profile, ecfg), is_prefill=False) for i in range(n)]
        else:
            self.prefills = [
                _Node(f"P{i}", Engine(profile, ecfg), is_prefill=True) for i in range(topo.prefill)
            ]
            self.decodes = [
                _Node(f"D{i}", Engine(profile, ecfg), is_prefill=False) for i in range(topo.decode)
            ]

    def _set_up_admission(self, adm: AdmissionSettings | None) -> None:
        self.admission = AdmissionQueue(adm) if adm is not None and adm.enabled else None
        self.admission_limit = adm.limit(len(self.decodes)) if adm is not None else None
        self.queued: dict[int, _Req] = {}  # admission tickets -> requests waiting (or just shed)

    def _set_up_steering(self, config: ClusterConfig, router: LocalPolicy | None) -> None:
        """Exploration and the SLO controller, the two things that steer ppd routing beyond the table."""
        self.explorer: ExplorationPolicy | None = None
        self.verdict_of: Callable[[str, Query], Verdict | None] | None = None
        if config.explore is not None and self.kind == "ppd":
            self.verdict_of = getattr(router, "verdict", None)
            if self.verdict_of is None:
                raise ValueError("exploration needs a router that gives verdicts (TableRouter)")
            self.explorer = ExplorationPolicy(config.explore)
        self.three_way = self.kind == "ppd" and config.ppd_bidir
        if self.three_way:
            self.verdict_of = getattr(router, "verdict", None)
            if self.verdict_of is None or config.explore is not None:
                raise ValueError("ppd_bidir needs a router that gives verdicts (TableRouter), no exploration")
        self.pins = self.kind == "bidir" or self.three_way  # D legs keep their blocks for the next turn
        self.slo: SloController | None = None
        self.slo_trace: list[tuple[float, SloState]] = []
        self.slo_weights = (0.0, 0.0)
        if config.slo is not None and self.kind == "ppd":
            # A policy the controller can steer scores with query.weights and names its own
            # (TableRouter.base_weights). Not a runtime-checked Protocol: mypyc compiles this module.
            base = getattr(router, "base_weights", None)
            if not isinstance(base, Weights):
                raise ValueError("slo needs a router with base weights (e.g. TableRouter.base_weights)")
            self.slo = SloController(config.slo, base.w_ttft, base.w_tpot)
            self.slo_weights = (base.w_ttft, base.w_tpot)

    # ------------------------------------------------------------------ heap helpers
    def push(self, t: float, kind: int, obj: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj))

    # ------------------------------------------------------------------ main loop
    def run(self, conversations: Iterable[Conversation]) -> ClusterResult:
        for n, conv in enumerate(conversations):
            if conv.turns:
                self.push(conv.start, _ARRIVE, _Req(conv, 0, self.blocks.of(conv, n), conv.start, 0))
        heap = self.heap
        while heap:
            t, _, kind, obj = heapq.heappop(heap)
            self.now = t
            self.events += 1
            if kind == _STEP:
                self.on_step(obj, t)
            elif kind == _XFER:
                self.on_transfer(obj[0], obj[1], t)
            elif kind == _RUN:
                self.end_run(obj[0], obj[1])
            elif kind == _ARRIVE:
                self.on_arrive(obj, t)
            elif kind == _DISPATCH:
                self.on_dispatch(obj, t)
            elif kind == _WAKE:
                self.on_wake(obj[0], obj[1], t)
            elif kind == _DRIFT:
                self.on_drift(obj, t)
            elif kind == _ADMIT:
                self.on_admission_deadline(t)
            else:
                self.on_timeouts(t)
        nodes = [*self.prefills, *self.decodes]
        return ClusterResult(
            self.build_records(),
            self.now,
            self.steps,
            self.events,
            {n.name: n.engine.stats() for n in nodes},
            {n.name: (n.engine.pool.num_free, n.engine.pool.num_blocks) for n in nodes},
            slo_trace=self.slo_trace,
            prefill_cached=self.prefill_cached,
            placed_by_prefix=self.placed_by_prefix,
            busy_s={n.name: n.busy_s for n in nodes},
        )

    def on_wake(self, node: _Node, version: int, t: float) -> None:
        if version == node.wake_version:
            node.wake_at = math.inf
            self.kick(node, t)

    def on_admission_deadline(self, t: float) -> None:
        """Queued requests past their class's wait bound are shed (ppd/admission.py rule 4)."""
        if self.admission is not None:
            for shed in self.admission.expire(t):
                self.shed(shed, t)

    # ------------------------------------------------------------------ routing
    def least_loaded(self, nodes: Sequence[_Node]) -> _Node:
        return min(nodes, key=lambda n: n.outstanding)

    def place(self, nodes: Sequence[_Node], req: _Req) -> _Node:
        """The gateway's placement (ppd/placement.py) over ``nodes``: least-loaded order (outstanding,
        then index: ``least_loaded``'s pick first), each with the prompt's blocks its prefix cache holds."""
        settings = self.cfg.placement
        if settings.policy == "least_loaded" or len(nodes) == 1:
            return self.least_loaded(nodes)
        ranked = sorted(nodes, key=lambda n: n.outstanding)  # stable: ties keep the index order
        content = req.content
        n_prompt = req.n_ctx + req.n_in
        placed = place(
            [
                Candidate(n.name, float(n.outstanding), n.engine.resident_prefix_blocks(content, n_prompt))
                for n in ranked
            ],
            settings,
        )
        node = ranked[placed.index]
        if placed.by_prefix:
            self.placed_by_prefix[req.rid] = node.name
        return node

    def on_arrive(self, req: _Req, t: float) -> None:
        """A request is sent: its client timeout starts; admission control (when on) says whether it
        is routed now, later or never."""
        req.deadline = t + self.cfg.timeout_s
        self.deadlines.append(req)
        if len(self.deadlines) == 1:
            self.push(req.deadline, _TIMEOUT, None)
        q, adm = self.admission, self.cfg.admission
        if q is None or adm is None:
            self.route(req, t)
            return
        tenant = req.conv.workload
        offer = q.offer(
            t, priority=adm.tenant(tenant).priority_for(None), tenant=tenant, limit=self.admission_limit
        )
        outcome = offer.outcome
        self.queued[outcome.ticket] = req
        if offer.displaced is not None:
            self.shed(offer.displaced, t)
        if isinstance(outcome, Admitted):
            self.admit(outcome, t)
        elif isinstance(outcome, Queued):
            self.push(outcome.deadline, _ADMIT, None)
        else:
            self.shed(outcome, t)

    def admit(self, admitted: Admitted, t: float) -> None:
        req = self.queued.pop(admitted.ticket)
        req.admitted = True
        self.route(req, t)

    def shed(self, shed: Shed, t: float) -> None:
        """Admission control shed a request: answered at once (429), its conversation ends."""
        req = self.queued.pop(shed.ticket)
        req.done = True
        req.error = f"shed_{shed.reason}"
        self.records.append(req)
        if self.observer is not None:
            self.observer.finished(self.record(req), t)

    def leave(self, req: _Req, t: float) -> None:
        """A request ended: its admission place goes to the next queued ones (or, queued, it leaves)."""
        q = self.admission
        if q is None:
            return
        if req.admitted:
            req.admitted = False
            for admitted in q.release(t, limit=self.admission_limit):
                self.admit(admitted, t)
            return
        for ticket, queued in list(self.queued.items()):
            if queued is req:
                q.cancel(ticket)
                del self.queued[ticket]

    def route(self, req: _Req, t: float) -> None:
        conv = req.conv
        self._live[req.rid] = req
        if self.replica_mode:
            node = self.sessions.get(conv.conversation_id) or self.least_loaded(self.decodes)
            self.sessions[conv.conversation_id] = node
            req.path = "replica"
            req.d = node
        elif req.idx == 0:
            req.path = "pd"
            req.d = self.place(self.decodes, req)
            self.sessions[conv.conversation_id] = req.d
        else:
            req.d = self.sessions[conv.conversation_id]
            if self.kind == "bidir":
                req.path = "bidir"
            elif self.three_way:
                req.path = self.choose_three_way(req)
            else:
                req.path = "local" if self.choose_local(req) else "pd"
        if self.pins:
            self.pinned.discard(conv.conversation_id)
            if req.path in ("pd", "bidir"):
                self.pinned.add(conv.conversation_id)
        if req.path in ("pd", "bidir"):
            req.p = self.place(self.prefills, req)
            req.p.outstanding += 1
        req.d.outstanding += 1
        delay = self.o_pd if req.p is not None else self.o_local
        self.push(t + delay, _DISPATCH, req)

    def choose_local(self, req: _Req) -> bool:
        if self.kind == "local":
            return True
        if self.kind == "pd":
            return False
        if self.kind == "fraction":
            return fraction_goes_local(req.conv.conversation_id, self.fraction)
        assert self.router is not None
        assert req.d is not None
        query = self.query(req)
        if self.explorer is None or self.verdict_of is None:
            return self.router.local(req.conv.conversation_id, query)
        verdict = self.verdict_of(req.conv.conversation_id, query)
        if verdict is None:
            return False  # refused: PD, as the gateway's fallback; no exploration
        e = self.explorer.decide(
            request_key=req.rid,
            chosen_local=verdict.local,
            alternative_allowed=verdict.alternative_allowed,
            worker=req.d.name,
            now=self.now,
            guard_active=verdict.reason is Reason.LIVE_SIGNAL,
        )
        req.explored, req.propensity = e.explored, e.propensity
        return e.local

    def query(self, req: _Req) -> Query:
        """ψ of a Turn 2+ request, with the live signals a gateway scrapes (and the SLO's weights)."""
        assert req.d is not None
        query = Query(
            turn=req.idx + 1,
            n_in=req.n_in,
            n_out=req.n_out,
            n_ctx=req.n_ctx,
            qps=self.cfg.target_qps,
            decode_running=req.d.engine.running_count(),
            prefill_queue_depth=self.least_loaded(self.prefills).engine.queue_depth(),
        )
        if self.slo is not None:
            query.weights = self.steer(req.arrival)
        return query

    def choose_three_way(self, req: _Req) -> str:
        """``ppd_bidir``: the verdict's path; BIDIR is offered only while D holds the last turn's pin."""
        assert self.verdict_of is not None
        query = self.query(req)
        query.bidir = req.conv.conversation_id in self.pinned
        verdict = self.verdict_of(req.conv.conversation_id, query)
        return "pd" if verdict is None else verdict.path

    def steer(self, t: float) -> Weights:
        """The SLO controller's weights at ``t``; each change is kept in the trace."""
        assert self.slo is not None
        w = self.slo.weights(t)
        if w != self.slo_weights:
            self.slo_weights = w
            self.slo_trace.append((t, self.slo.state(t)))
        return Weights(*w)

    def on_dispatch(self, req: _Req, t: float) -> None:
        if req.done:
            return
        n_prompt = req.n_ctx + req.n_in
        if req.p is not None:
            r = EngineRequest(
                request_id=req.rid,
                n_prompt=n_prompt,
                content=req.content,
                max_tokens=1,
                remote_decode=True,
                # bidir: the KV D computed last turn (its prompt + output but the last token)
                remote_prefix_tokens=req.n_ctx - 1 if req.path == "bidir" else 0,
            )
            self.settle(req.p, t)
            req.p.engine.add_request(r, t)
            self.kick(req.p, t)
        else:
            assert req.d is not None
            r = EngineRequest(
                request_id=req.rid,
                n_prompt=n_prompt,
                content=req.content,
                max_tokens=req.n_out,
                ignore_eos=True,
            )
            self.settle(req.d, t)
            req.d.engine.add_request(r, t)
            self.kick(req.d, t)

    # ------------------------------------------------------------------ engines
    def kick(self, node: _Node, t: float) -> None:
        """Start the node's next step at ``t`` if it is free and has work (or wait for it, or go lazy)."""
        engine = node.engine
        while node.inflight is None and node.lazy_from is None:
            nxt = engine.next_step_at()
            if nxt is None:
                return
            if nxt > t:
                # One pending wake-up at or before nxt is enough: it kicks again, and kick re-arms.
                if not t < node.wake_at <= nxt:
                    node.wake_version += 1
                    node.wake_at = nxt
                    self.push(nxt, _WAKE, (node, node.wake_version))
                return
            end = engine.run_end(t)
            if end is not None:
                node.lazy_from = t
                node.run_version += 1
                self.push(end, _RUN, (node, node.run_version))
                return
            self.started(node, engine.step(t), t)

    def started(self, node: _Node, result: StepResult, t: float) -> None:
        self.steps += result.n_steps
        for pull in result.kv_pulls:
            self.start_pull(node, pull.request_id, pull.n_tokens, t)
        if result.duration > 0 or result.finished or result.first_tokens:
            node.inflight = result
            self.push(result.end, _STEP, node)

    def settle(self, node: _Node, t: float) -> None:
        """Before a change reaches the node's engine at ``t``: make the steps of its lazy run that start
        before ``t``; the step in flight at ``t`` ends as planned and the change joins the next one."""
        start = node.lazy_from
        if start is None:
            return
        node.lazy_from = None
        node.run_version += 1
        self.started(node, node.engine.step(start, t), start)

    def end_run(self, node: _Node, version: int) -> None:
        """Nothing reached a lazy run's engine before its end: make the whole run now and finish it."""
        if version != node.run_version:
            return
        start = node.lazy_from
        assert start is not None
        node.lazy_from = None
        result = node.engine.step(start)
        self.steps += result.n_steps
        node.inflight = result
        self.on_step(node, result.end)

    def on_step(self, node: _Node, t: float) -> None:
        result = node.inflight
        assert result is not None
        node.inflight = None
        node.busy_s += result.duration
        reqs = self._live
        if node.is_prefill:
            for fin in result.finished:
                req = reqs.get(fin.request_id)
                if req is None:
                    node.engine.release(fin.request_id, t)
                    continue
                node.outstanding -= 1
                req.p_done = True
                self.prefill_cached[req.rid] = fin.num_cached_tokens
                assert req.d is not None
                r = EngineRequest(
                    request_id=req.rid,
                    n_prompt=req.n_ctx + req.n_in,
                    content=req.content,
                    max_tokens=req.n_out,
                    ignore_eos=True,
                    remote_prefill=True,
                    kv_ttl_s=self.d_ttl,
                )
                self.settle(req.d, t)
                if req.path == "bidir":  # P pulled nothing from D: D's pin goes (vLLM notifies D)
                    req.d.engine.release(_previous(req), t)
                req.d.engine.add_request(r, t)
                self.kick(req.d, t)
        else:
            for rid in result.first_tokens:
                req = reqs.get(rid)
                if req is not None:
                    req.first = t
            for fin in result.finished:
                req = reqs.get(fin.request_id)
                if req is None:
                    continue
                if fin.reason is FinishReason.ERROR:
                    self.fail(req, "kv_transfer_failed", t)
                else:
                    self.complete(req, t)
        self.kick(node, t)

    def start_pull(self, node: _Node, rid: str, n_tokens: int, t: float) -> None:
        """``node`` pulls: D reads P's lease, or (bidir) P reads the session's D over the reverse link."""
        req = self._live.get(rid)
        if req is None or req.p is None or req.d is None:
            return
        key = (self.prefills.index(req.p), self.decodes.index(req.d))
        ls = self.reverse_links[key] if node.is_prefill else self.links[key]
        tid = ls.link.start(t, n_tokens * self.profile.model.kv_bytes_per_token)
        ls.owners[tid] = req
        req.transfer = (ls, tid)
        self.schedule_link(ls)

    def schedule_link(self, ls: _LinkState) -> None:
        nxt = ls.link.next_completion_at()
        ls.version += 1
        if nxt is not None:
            self.push(nxt, _XFER, (ls, ls.version))

    def on_transfer(self, ls: _LinkState, version: int, t: float) -> None:
        if version != ls.version:
            return
        for done in ls.link.completions_until(t):
            req = ls.owners.pop(done.transfer_id, None)
            if req is None or req.done:
                continue
            req.transfer = None
            assert req.p is not None
            assert req.d is not None
            if ls.reverse:
                self.reverse_done(req, done.stall_s, t)
            elif req.p.engine.lease_alive(req.rid, t):
                self.settle(req.p, t)
                req.p.engine.release(req.rid, t)
                self.settle(req.d, t)
                req.d.engine.kv_loaded(req.rid, t, done.stall_s)
                self.kick(req.d, t)
                self.kick(req.p, t)  # the freed blocks may let a waiting prefill in
            else:
                self.settle(req.d, t)
                req.d.engine.kv_failed(req.rid, t)
                self.fail(req, "kv_lease_expired", t)
        self.schedule_link(ls)

    def reverse_done(self, req: _Req, stall_s: float, t: float) -> None:
        """A bidirectional P leg has D's blocks: D's pin goes, P computes the rest (or D's pin expired)."""
        assert req.p is not None
        assert req.d is not None
        previous = _previous(req)
        if req.d.engine.lease_alive(previous, t):
            self.settle(req.d, t)
            req.d.engine.release(previous, t)
            self.settle(req.p, t)
            req.p.engine.kv_loaded(req.rid, t, stall_s)
            self.kick(req.p, t)
            self.kick(req.d, t)
        else:
            self.settle(req.p, t)
            req.p.engine.kv_failed(req.rid, t)
            self.fail(req, "kv_lease_expired", t)

    def on_drift(self, event: DriftEvent, t: float) -> None:
        """The links and workers change at ``t``; each factor is relative to the configured cluster."""
        if event.link is not None:
            bandwidth = self.profile.link(self.cfg.link).bandwidth_bytes_per_s * event.link
            for ls in (*self.links.values(), *self.reverse_links.values()):
                ls.link.set_bandwidth(t, bandwidth)
                self.schedule_link(ls)
        for nodes, factor in ((self.decodes, event.decode), (self.prefills, event.prefill)):
            if factor is None:
                continue
            cost = CostModel(slowed(self.profile, factor))
            for node in nodes:
                self.settle(node, t)  # the run's steps before t keep the old price
                node.engine.set_cost(cost)

    # ------------------------------------------------------------------ outcomes
    def complete(self, req: _Req, t: float) -> None:
        req.finish = t
        req.done = True
        if self.slo is not None:
            first = req.first
            self.slo.observe(
                t,
                ttft_s=first - req.arrival if first is not None else None,
                tpot_s=(t - first) / (req.n_out - 1) if first is not None and req.n_out > 1 else None,
                started=req.arrival,
            )
        self._live.pop(req.rid, None)
        assert req.d is not None
        req.d.outstanding -= 1
        self.records.append(req)
        self.leave(req, t)
        if self.observer is not None:
            self.observer.finished(self.record(req), t)
        nxt = req.idx + 1
        if nxt < len(req.conv.turns):
            at = t + self.cfg.think_time_s
            self.push(at, _ARRIVE, _Req(req.conv, nxt, req.content, at, req.n_ctx + req.n_in + req.n_out))

    def fail(self, req: _Req, error: str, t: float) -> None:
        if req.done:
            return
        req.done = True
        req.error = error
        self._live.pop(req.rid, None)
        if req.p is not None:
            self.settle(req.p, t)
            req.p.engine.abort(req.rid, t)
            if not req.p_done:
                req.p.outstanding -= 1
            self.kick(req.p, t)
        if req.transfer is not None:
            ls, tid = req.transfer
            ls.link.cancel(tid, t)
            ls.owners.pop(tid, None)
            self.schedule_link(ls)
        if req.d is not None:
            self.settle(req.d, t)
            req.d.engine.abort(req.rid, t)
            req.d.outstanding -= 1
            self.kick(req.d, t)
        self.records.append(req)
        if self.observer is not None:
            self.observer.finished(self.record(req), t)
        self.leave(req, t)

    def on_timeouts(self, t: float) -> None:
        """Fail the requests whose deadline is ``t`` or earlier, then wait for the next live one's."""
        deadlines = self.deadlines
        while deadlines and deadlines[0].deadline <= t:
            req = deadlines.popleft()
            if not req.done:
                self.fail(req, "timeout", t)
        while deadlines and deadlines[0].done:
            deadlines.popleft()
        if deadlines:
            self.push(deadlines[0].deadline, _TIMEOUT, None)

    def build_records(self) -> list[dict[str, Any]]:
        return [self.record(req) for req in sorted(self.records, key=lambda r: (r.arrival, r.rid))]

    def record(self, req: _Req) -> dict[str, Any]:
        cfg = self.cfg
        run_id, shape, model, mode, qps = cfg.run_id, cfg.topology.label, cfg.model, cfg.mode, cfg.target_qps
        first, finish, arrival, n_out = req.first, req.finish, req.arrival, req.n_out
        ok = req.error is None and finish is not None
        tpot = None
        if ok and first is not None and finish is not None and n_out > 1:
            tpot = (finish - first) * 1e3 / (n_out - 1)
        record: dict[str, Any] = {
            "run_id": run_id,
            "shape": shape,
            "model": model,
            "mode": mode,
            "target_qps": qps,
            "workload": req.conv.workload,
            "conversation_id": req.conv.conversation_id,
            "turn": req.idx + 1,
            "n_in": req.n_in,
            "n_out": n_out,
            "n_ctx": req.n_ctx,
            "path": req.path,
            "ttft_ms": (first - arrival) * 1e3 if first is not None else None,
            "tpot_ms": tpot,
            "e2e_ms": (finish - arrival) * 1e3 if ok and finish is not None else None,
            "ok": ok,
            "error": req.error,
            "start_time": arrival,
        }
        if req.explored or req.propensity != 1.0:  # ppd/records.py: left out at their defaults
            record.update(explored=req.explored, propensity=req.propensity)
        return record


def _previous(req: _Req) -> str:
    """The id of the conversation's previous turn: what its D leg pinned in bidir mode."""
    return f"{req.conv.conversation_id}#{req.idx}"


def simulate(
    profile: Profile,
    config: ClusterConfig,
    conversations: Iterable[Conversation],
    router: LocalPolicy | None = None,
    observer: RecordObserver | None = None,
) -> ClusterResult:
    """Run the conversations through a simulated cluster; one record per request sent."""
    return _Sim(profile, config, router, observer).run(conversations)

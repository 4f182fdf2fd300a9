"""The decision rule: psi -> PD (x=0) or LOCAL (x=1), or BIDIR for a caller that can serve it.

Rule 1 (docs/architecture.md, "The decision"): turn 1 is always PD. Otherwise psi maps to a cell (context
class, workload class, nearest QPS level) and the cell's measured deltas are scored as
S = w_ttft * delta_ttft - w_tpot * delta_tpot; LOCAL when S > 0, where
delta_ttft = (ttft_pd - ttft_local) / ttft_pd (relative TTFT gain of LOCAL) and
delta_tpot = (tpot_local - tpot_pd) / tpot_pd (relative TPOT loss of LOCAL).
Rule 2: a mode that missed the success SLO in a cell loses to one that met it, whatever the weights.
Rule 3: a cell without data is never silently LOCAL: the nearest measured QPS level of the same
(context, workload) answers (NEAREST_CELL), else the table's default decision (DEFAULT).
Rule 4: a live decode KV usage above the table's limit turns LOCAL into PD (LIVE_SIGNAL).
Rule 5 (decode-load guard): more running requests on the session's decode worker than the table's
        ``max_decode_running`` turn LOCAL into PD (LIVE_SIGNAL), unless the prefill queue is deeper than
        ``max_prefill_queue_depth`` (then P is the scarcer side and LOCAL stays). An append-prefill's
        TPOT cost grows with the decode batch it joins (the paper's micro-benchmark: +21% at batch 200),
        and a saturated decode worker times out long answers; moving the prefill to an idle P relieves
        it. A signal the caller did not send, or a limit the table does not set, never fires.
Rule 6 (where exploration may go, ``ppd/explore.py``): ``alternative_allowed`` says whether the path
        the verdict did not choose is safe to take: it met the success SLO in the cell that answered
        (the nearest measured level's figures) and, when it is LOCAL, no live signal forbids it
        (rules 4 and 5). Never for turn 1 or a (context, workload) without measurements.
Rule 7 (the third path, BIDIR: vLLM's bidirectional KV mode): considered only when the caller says it
        can serve it (``Query.bidir``, the request's CAPABILITY_BIDIR) and the cell that answered (the
        nearest measured level) has BIDIR figures. Otherwise rules 1-6 answer alone, and the verdict is
        exactly what it was before the mode existed. When considered: every allowed path is scored
        against PD by the same S with its own deltas (delta_ttft_bidir = (ttft_pd - ttft_bidir) /
        ttft_pd, delta_tpot_bidir = (tpot_bidir - tpot_pd) / tpot_pd); the highest S > 0 wins, else PD
        (ties: PD, then LOCAL, then BIDIR). Like LOCAL (rule 2), BIDIR must meet the success SLO: when
        it misses it, it is not considered and the answer is the two-path one with reason
        BIDIR_FAILED_IN_CELL (unless a PD/LOCAL failure or a live signal already explains it). When it
        meets it, the paths that missed the SLO are dropped (reason PD_FAILED_IN_CELL, else
        LOCAL_FAILED_IN_CELL) and S picks among the rest. Live signals (rules 4, 5) forbid LOCAL only:
        the better of PD and BIDIR takes its place. A BIDIR answer has ``alternative_allowed`` False
        (exploration flips PD and LOCAL only).

``Router`` precomputes, once per table, every cell's default-weight verdict (and, where rule 7 applies,
the three-path one), so the common call (no explicit weights) is a classification plus one tuple index
and allocates nothing.

It stays whole (about 460 lines): the seven rules are one decision over one compiled cell, and rule 7
is the two-path verdict extended, read next to rules 2-6 it changes nothing for; apart, its half would
only import this half's types back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import IntEnum

from decision_service.classify import CompiledClassifier
from decision_service.header import Figure, Weights
from decision_service.table import Table

__all__ = [
    "MAX_TOKENS",
    "PATHS",
    "BidirRule",
    "CellRule",
    "Query",
    "QueryError",
    "Reason",
    "Router",
    "Verdict",
    "check_query",
    "route",
]

# Larger token counts are a caller bug, not a workload (no model has a 100M-token context).
MAX_TOKENS = 100_000_000


class Reason(IntEnum):
    """Why a decision was taken; numbered exactly like ``ppd.decision.v1.Reason``."""

    TURN_ONE = 1
    TABLE = 2
    WEIGHTS = 3
    PD_FAILED_IN_CELL = 4
    LOCAL_FAILED_IN_CELL = 5
    NEAREST_CELL = 6
    DEFAULT = 7
    LIVE_SIGNAL = 8
    BIDIR_FAILED_IN_CELL = 9


# What the servicer and metrics call each path.
PD, LOCAL, BIDIR = "pd", "local", "bidir"
PATHS = (PD, LOCAL, BIDIR)


class QueryError(ValueError):
    """The query cannot be answered as asked (maps to INVALID_ARGUMENT)."""


# Not frozen, unlike the verdicts: one is built per Route call, and a frozen dataclass's __init__
# (object.__setattr__ per field) costs about three times as much on that path. Nothing keeps one.
@dataclass(slots=True, kw_only=True)
class Query:
    """psi plus the caller's options. ``None`` means "not given"."""

    turn: int
    n_in: int
    n_out: int
    n_ctx: int
    qps: float
    weights: Weights | None = None
    profile: str | None = None
    decode_kv_usage: float | None = None
    prefill_queue_depth: int | None = None
    decode_running: int | None = None
    # The caller can serve BIDIR (the request's CAPABILITY_BIDIR): rule 7.
    bidir: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """A decision with its provenance. ``context``/``workload``/``qps_level`` are None for turn 1."""

    local: bool
    reason: Reason
    context: str | None
    workload: str | None
    qps_level: float | None
    score: float
    default_local: bool
    detail: str
    # Rule 6: the path not chosen passes the cell's success SLO (and no live signal forbids LOCAL).
    alternative_allowed: bool = False
    # Rule 7: BIDIR (then ``local`` is False), and what the default weights decide for this caller.
    bidir: bool = False
    default_bidir: bool = False

    @property
    def path(self) -> str:
        """ "pd", "local" or "bidir"."""
        return BIDIR if self.bidir else LOCAL if self.local else PD


@dataclass(frozen=True, slots=True, kw_only=True)
class BidirRule:
    """A cell's BIDIR figures compiled (rule 7): its deltas against PD, whether it met the success SLO,
    and the default-weight verdict for a caller that can serve it."""

    delta_ttft: float
    delta_tpot: float
    success: float
    passes: bool
    verdict: Verdict


@dataclass(frozen=True, slots=True, kw_only=True)
class CellRule:
    """One compiled cell: its deltas (from the nearest measured level) and default-weight verdict."""

    context: str
    workload: str
    qps_level: float
    delta_ttft: float
    delta_tpot: float
    # Set when one mode missed the SLO: (local?, reason); the weights do not matter then.
    forced: tuple[bool, Reason] | None
    verdict: Verdict
    # Whether each mode met the success SLO here (both False without measurements): rule 6.
    pd_passes: bool = False
    local_passes: bool = False
    # Rule 7: set when the row that answers has BIDIR figures.
    bidir: BidirRule | None = None
    # The row's success rates and QPS-level note, for BIDIR details.
    pd_success: float = 0.0
    local_success: float = 0.0
    nearest_note: str = ""


def check_query(q: Query, table: Table) -> None:
    """Raise QueryError with a message naming the bad field; return silently when ``q`` is answerable."""
    if q.turn < 1:
        raise QueryError(f"turn must be >= 1, got {q.turn}")
    for name, value in (
        ("new_input_tokens", q.n_in),
        ("expected_output_tokens", q.n_out),
        ("context_tokens", q.n_ctx),
    ):
        if value < 0 or value > MAX_TOKENS:
            raise QueryError(f"{name} must be within 0..{MAX_TOKENS}, got {value}")
    if not math.isfinite(q.qps) or q.qps < 0:
        raise QueryError(f"qps must be a finite number >= 0, got {q.qps}")
    if q.weights is not None:
        w = q.weights
        if not (math.isfinite(w.w_ttft) and math.isfinite(w.w_tpot)) or w.w_ttft < 0 or w.w_tpot < 0:
            raise QueryError(f"weights must be finite and >= 0, got w_ttft={w.w_ttft} w_tpot={w.w_tpot}")
        if w.w_ttft == 0 and w.w_tpot == 0:
            raise QueryError("weights w_ttft and w_tpot are both zero")
    if q.profile is not None and q.profile not in table.header.profiles:
        known = ", ".join(sorted(table.header.profiles)) or "none"
        raise QueryError(f"unknown weights profile {q.profile!r} (table {table.key} has: {known})")
    if q.decode_kv_usage is not None and not (0.0 <= q.decode_kv_usage <= 1.0):
        raise QueryError(f"decode_kv_usage must be within 0..1, got {q.decode_kv_usage}")
    for name, count in (
        ("prefill_queue_depth", q.prefill_queue_depth),
        ("decode_running_requests", q.decode_running),
    ):
        if count is not None and count < 0:
            raise QueryError(f"{name} must be >= 0, got {count}")


class Router:
    """One table compiled for lookups. Immutable; build one per loaded table."""

    __slots__ = ("_cells", "_classifier", "_turn_one", "table")

    def __init__(self, table: Table) -> None:
        self.table = table
        self._classifier = CompiledClassifier(table.header.axes)
        nc, nw, nq = table.header.axes.shape
        default_local = table.header.default_decision == "local"
        self._turn_one = Verdict(
            local=False,
            reason=Reason.TURN_ONE,
            context=None,
            workload=None,
            qps_level=None,
            score=0.0,
            default_local=False,
            detail="turn 1 always takes PD",
        )
        cells: list[CellRule] = []
        for c in range(nc):
            for w in range(nw):
                measured_q = [q for q in range(nq) if table.measured(c, w, q)]
                for q in range(nq):
                    cells.append(self._compile_cell(c, w, q, measured_q, default_local))
        self._cells = tuple(cells)

    def _compile_cell(self, c: int, w: int, q: int, measured_q: list[int], default_local: bool) -> CellRule:
        h = self.table.header
        axes = h.axes
        ctx, wl = axes.context_classes[c], axes.workloads[w].name
        level = axes.qps_levels[q]
        if not measured_q:
            v = Verdict(
                local=default_local,
                reason=Reason.DEFAULT,
                context=ctx,
                workload=wl,
                qps_level=level,
                score=0.0,
                default_local=default_local,
                detail=f"no measurements for ({ctx}, {wl}) at any QPS; table default {h.default_decision}",
            )
            return CellRule(
                context=ctx,
                workload=wl,
                qps_level=level,
                delta_ttft=0.0,
                delta_tpot=0.0,
                forced=(default_local, Reason.DEFAULT),
                verdict=v,
            )
        # Nearest measured level; on a tie the lower one (its figures are the less optimistic for PD).
        src = min(measured_q, key=lambda m: (abs(axes.qps_levels[m] - level), m))
        row = self.table.figures[c, w, src]
        pd_ttft, pd_tpot = float(row[Figure.PD_TTFT_MS]), float(row[Figure.PD_TPOT_MS])
        lo_ttft, lo_tpot = float(row[Figure.LOCAL_TTFT_MS]), float(row[Figure.LOCAL_TPOT_MS])
        pd_ok, lo_ok = float(row[Figure.PD_SUCCESS]), float(row[Figure.LOCAL_SUCCESS])
        d_ttft = (pd_ttft - lo_ttft) / pd_ttft
        d_tpot = (lo_tpot - pd_tpot) / pd_tpot
        forced: tuple[bool, Reason] | None = None
        pd_failed, lo_failed = pd_ok < h.min_success, lo_ok < h.min_success
        if pd_failed and (not lo_failed or lo_ok > pd_ok):
            forced = (True, Reason.PD_FAILED_IN_CELL)
        elif lo_failed and (not pd_failed or pd_ok > lo_ok):
            forced = (False, Reason.LOCAL_FAILED_IN_CELL)
        dw = h.default_weights
        score = dw.w_ttft * d_ttft - dw.w_tpot * d_tpot
        used = axes.qps_levels[src]
        if forced is not None:
            local, reason = forced
            detail = f"success pd={pd_ok:.3f} local={lo_ok:.3f} vs SLO {h.min_success}"
        else:
            local, reason = score > 0, Reason.TABLE
            detail = ""
        if src != q:
            detail = f"no measurements at {level:g} QPS; nearest measured level {used:g}" + (
                f"; {detail}" if detail else ""
            )
            if forced is None:
                reason = Reason.NEAREST_CELL
            forced = (local, reason) if forced is not None else None
        v = Verdict(
            local=local,
            reason=reason,
            context=ctx,
            workload=wl,
            qps_level=used,
            score=score,
            default_local=local,
            detail=detail,
            alternative_allowed=not pd_failed if local else not lo_failed,
        )
        rule = CellRule(
            context=ctx,
            workload=wl,
            qps_level=used,
            delta_ttft=d_ttft,
            delta_tpot=d_tpot,
            forced=forced,
            verdict=v,
            pd_passes=not pd_failed,
            local_passes=not lo_failed,
            pd_success=pd_ok,
            local_success=lo_ok,
            nearest_note=""
            if src == q
            else f"no measurements at {level:g} QPS; nearest measured level {used:g}",
        )
        if not self.table.has_bidir(c, w, src):
            return rule
        bi_ttft, bi_tpot = float(row[Figure.BIDIR_TTFT_MS]), float(row[Figure.BIDIR_TPOT_MS])
        bi_ok = float(row[Figure.BIDIR_SUCCESS])
        partial = BidirRule(
            delta_ttft=(pd_ttft - bi_ttft) / pd_ttft,
            delta_tpot=(bi_tpot - pd_tpot) / pd_tpot,
            success=bi_ok,
            passes=bi_ok >= h.min_success,
            verdict=v,
        )
        rule = dataclasses.replace(rule, bidir=partial)
        three = _three_way(rule, partial, dw, weighted=False, h_min_success=h.min_success)
        three = dataclasses.replace(three, default_local=three.local, default_bidir=three.bidir)
        return dataclasses.replace(rule, bidir=dataclasses.replace(partial, verdict=three))

    def cell(self, c: int, w: int, q: int) -> CellRule:
        """The compiled rule of cell (context c, workload w, QPS level q)."""
        _, nw, nq = self.table.header.axes.shape
        return self._cells[(c * nw + w) * nq + q]

    def route(self, q: Query) -> Verdict:
        """Decide ``q``. Assumes ``check_query`` passed; total over every such query."""
        if q.turn == 1:
            return self._turn_one
        cell = self._cells[self._classifier.cell_index(q.n_in, q.n_out, q.n_ctx, q.qps)]
        weights = q.weights
        header = self.table.header
        if weights is None and q.profile is not None:
            weights = header.profiles[q.profile]
        if q.bidir and cell.bidir is not None:
            return self._route_bidir(q, cell, cell.bidir, weights)
        v = cell.verdict
        if weights is not None and cell.forced is None and weights != header.default_weights:
            score = weights.w_ttft * cell.delta_ttft - weights.w_tpot * cell.delta_tpot
            reason = Reason.WEIGHTS if v.reason is Reason.TABLE else v.reason
            local = score > 0
            allowed = cell.pd_passes if local else cell.local_passes
            v = dataclasses.replace(v, local=local, reason=reason, score=score, alternative_allowed=allowed)
        if v.local:
            overload = self._live_overload(q)
            if overload is not None:
                v = dataclasses.replace(
                    v, local=False, reason=Reason.LIVE_SIGNAL, detail=overload, alternative_allowed=False
                )
        elif v.alternative_allowed and self._live_overload(q) is not None:
            v = dataclasses.replace(v, alternative_allowed=False)  # rule 6: LOCAL is forbidden now
        return v

    def capable_verdict(self, cell: CellRule, weights: Weights | None) -> Verdict | None:
        """Rule 7 before live signals: what a caller that can serve BIDIR is answered in ``cell`` under
        ``weights`` (None: the table's), or None where the cell has no BIDIR figures (it gets the two-path
        answer). ``ppd-table refresh`` compares these before and after a merge."""
        return None if cell.bidir is None else self._three_path(cell, cell.bidir, weights)

    def _three_path(self, cell: CellRule, b: BidirRule, weights: Weights | None) -> Verdict:
        h = self.table.header
        v = b.verdict
        if weights is not None and weights != h.default_weights:
            fresh = _three_way(cell, b, weights, weighted=True, h_min_success=h.min_success)
            v = dataclasses.replace(fresh, default_local=v.default_local, default_bidir=v.default_bidir)
        return v

    def _route_bidir(self, q: Query, cell: CellRule, b: BidirRule, weights: Weights | None) -> Verdict:
        """Rule 7: the three-path verdict for a caller that can serve BIDIR, in a cell with its figures."""
        h = self.table.header
        v = self._three_path(cell, b, weights)
        if v.local:
            overload = self._live_overload(q)
            if overload is not None:
                # LOCAL is forbidden now: the better of PD and BIDIR (BIDIR only if it met the SLO).
                w = weights if weights is not None else h.default_weights
                s_bidir = w.w_ttft * b.delta_ttft - w.w_tpot * b.delta_tpot
                bidir = b.passes and (s_bidir > 0 or not cell.pd_passes)
                v = dataclasses.replace(
                    v,
                    local=False,
                    bidir=bidir,
                    reason=Reason.LIVE_SIGNAL,
                    score=s_bidir if bidir else v.score,
                    detail=overload,
                    alternative_allowed=False,
                )
        elif not v.bidir and v.alternative_allowed and self._live_overload(q) is not None:
            v = dataclasses.replace(v, alternative_allowed=False)  # rule 6: LOCAL is forbidden now
        return v

    def _live_overload(self, q: Query) -> str | None:
        """Why a live signal forbids LOCAL (rules 4 and 5), or None when none does."""
        h = self.table.header
        if q.decode_kv_usage is not None and q.decode_kv_usage > h.max_decode_kv_usage:
            return f"decode KV usage {q.decode_kv_usage:.2f} above the table's limit {h.max_decode_kv_usage}"
        limit = h.max_decode_running
        if limit is None or q.decode_running is None or q.decode_running <= limit:
            return None
        queue_limit, queue = h.max_prefill_queue_depth, q.prefill_queue_depth
        if queue_limit is not None and queue is not None and queue > queue_limit:
            return None  # P is the scarcer side: keep the prefill on D
        return f"decode worker runs {q.decode_running} requests, above the table's limit {limit}"


def _three_way(
    cell: CellRule, b: BidirRule, weights: Weights, *, weighted: bool, h_min_success: float
) -> Verdict:
    """Rule 7 under ``weights``, before live signals. ``weighted``: the caller's weights, not the
    table's (reason WEIGHTS instead of TABLE)."""
    two = cell.verdict
    s_local = weights.w_ttft * cell.delta_ttft - weights.w_tpot * cell.delta_tpot
    s_bidir = weights.w_ttft * b.delta_ttft - weights.w_tpot * b.delta_tpot
    unforced_reason = Reason.WEIGHTS if weighted and two.reason is Reason.TABLE else two.reason
    successes = f"success pd={cell.pd_success:.3f} local={cell.local_success:.3f} bidir={b.success:.3f}"
    note = cell.nearest_note
    if not b.passes:
        # BIDIR is not considered: the two-path answer (rules 2-3 as route() gives it), with BIDIR's
        # failure named unless a PD/LOCAL failure explains the answer already.
        if cell.forced is not None:
            return two
        local = s_local > 0
        return dataclasses.replace(
            two,
            local=local,
            reason=Reason.BIDIR_FAILED_IN_CELL,
            score=s_local,
            detail=f"{note}; {successes} vs SLO {h_min_success}"
            if note
            else f"{successes} vs SLO {h_min_success}",
            alternative_allowed=cell.pd_passes if local else cell.local_passes,
        )
    candidates: list[tuple[str, float]] = []
    if cell.pd_passes:
        candidates.append((PD, 0.0))
    if cell.local_passes:
        candidates.append((LOCAL, s_local))
    candidates.append((BIDIR, s_bidir))
    best, best_score = candidates[0]
    for path, score in candidates[1:]:
        if score > best_score:
            best, best_score = path, score
    if best == PD:
        best_score = max(score for path, score in candidates if path != PD)
    if not cell.pd_passes or not cell.local_passes:
        reason = Reason.PD_FAILED_IN_CELL if not cell.pd_passes else Reason.LOCAL_FAILED_IN_CELL
        detail = f"{successes} vs SLO {h_min_success}"
        detail = f"{note}; {detail}" if note else detail
    else:
        reason, detail = unforced_reason, note
    return dataclasses.replace(
        two,
        local=best == LOCAL,
        bidir=best == BIDIR,
        reason=reason,
        score=best_score,
        detail=detail,
        alternative_allowed=cell.pd_passes if best == LOCAL else cell.local_passes if best == PD else False,
    )


def route(table: Table, query: Query) -> Verdict:
    """Check and decide one query against ``table`` (convenience; servers keep a ``Router``)."""
    check_query(query, table)
    return Router(table).route(query)

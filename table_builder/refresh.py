"""A table refreshed from production logs: logged evidence merged into a base table, cell by cell,
with a drift report.

Rules:

1. Evidence is every Turn-2+ record of the base table's shape and model whose mode is ``ppd`` (the
   gateway's per-request routing, chosen or explored) or a static ``pd`` / ``local`` / ``bidir``
   benchmark run (one with a ``target_qps``), filed under the path it took (``pd``, ``local`` or
   ``bidir``) in the cell the decision service's own classifier gives (``build.axes_locator``; a
   production line by its token counts alone, whatever its ``workload`` label says, as the service
   placed it; a benchmark record's label may name the class it measured). Who is trusted for what: the
   gateway's own routing for the path, the workers for the latencies and failures; a client for
   nothing. So these are left out and counted: other modes; a static mode in a production log (no
   ``target_qps``: a client asked for that path with ``X-PPD-Mode``, the gateway did not choose it);
   a request whose client went away (``error`` ``ppd.records.CLIENT_DISCONNECTED``) or that a worker
   refused as a bad request (a 4xx but 408 and 429; ``ppd.records.client_caused``): no failure of the
   path or its worker; the ``replica`` path; Turn-1 records; other shapes/models; and a line that
   repeats one already read (the same request twice: a log given twice, a folder and a file in it, a
   rotated copy). Each figure is bounded: a completed request whose TTFT or TPOT lies beyond
   ``timeout_ms`` (default the base's benchmark timeout, ``censored_ttft_ms``, 30 s) counts as one that
   did not complete in time (sent, not completed, its latencies left out), as the benchmark that built
   the base counts a timeout; so one line moves a path's mean by at most ``timeout_ms / n`` and its
   success rate by ``1 / n``, and no sum can overflow (the report notes how many). Exploration marks
   and propensities are not read: within one
   cell the path a request took is either the table's answer for all of that cell's traffic or a seeded
   draw that does not depend on the request's figures, so the plain per-path mean is already the mean of
   that path over the cell's traffic (inverse-propensity weights would matter for the value of the routing
   policy as a whole, which a refresh does not estimate).
2. QPS: a record's ``target_qps`` when it has one (benchmark runs, the simulator); a production log
   line has 0 (no fixed load level), and then its load level is the arrival rate of the logs
   themselves in the table's unit, conversations per second (a benchmark's ``target_qps`` is the
   rate conversations arrive at, whatever their turns): the Turn-1 records of the shape and model
   with ``target_qps`` 0 (every gateway's log together: the cluster's offered load), counted over
   ``qps_window_s`` seconds (10 s, the gateway's own ``policy.qps_window_s``) centred on its start,
   the window moved inside the logs' span at either end. Counting every turn would file a two-turn
   mix at twice its level. Around a gap in the logs (an idle night) the rate of the lines within half
   a window of it is undercounted.
3. Merge, per cell and path, weighted by sample counts: the table stores a mean over its completed
   requests (``sent x success``) and the number sent, so the merged mean is ``(base mean x base completed
   + sum of logged values) / (base completed + logged completed)``, the success rate ``(base completed +
   logged completed) / (base sent + logged sent)``, and the count the sum of both. A path the logs do not
   show keeps its base figures. A cell the base leaves empty is filled only when the logs show both pd and
   local (as ``build`` would fill it). The ``bidir`` path merges the same way into the BIDIR figures of a
   measured cell that has them; where the cell has none (or is filled from the logs), the logged bidir
   figures alone become them (``build``'s rule 5). Sums are exact (``math.fsum``), so the same evidence in
   any order gives the same bytes.
4. No flip below the sample minimum: if a cell's answers (under the table's default weights and each named
   profile, as the router compiles them, the success SLO and the nearest-measured-level rule included; for
   callers that can serve BIDIR too, where the cell has BIDIR figures) differ from the base's, the cell
   the answer is read from must hold at least ``min_samples`` logged requests (all paths together).
   Otherwise that cell keeps its base figures this time ("held"); the logs are kept, and a later refresh
   with more evidence may flip it.
5. Drift: a figure moved beyond the confidence bound when its logged mean differs from the base's by
   more than z standard errors, z the two-sided normal quantile of ``confidence``. Latencies: the
   standard error of the difference of two means, ``s x sqrt(1/n_logged + 1/n_base)``, with the
   logged values' standard deviation ``s`` standing in for the base's (a table stores no spread).
   Success rates: the two-proportion test with the pooled rate. Only figures with at least two
   logged values in a measured base cell are tested; a gap within float rounding is none, and with
   no spread at all any other gap is drift. A held cell's drift is reported too (what the logs
   show), though its figures stay.
6. Deterministic: no clock. The build time is the newest record's start (as ``build`` does); the
   provenance names the base (its version and provenance), the logs' digest (over the distinct
   records), the timeout and the rules' version.
   Merge into the table the logs were *not* already merged into: the base is the offline-built
   table, kept apart from the published one (a refreshed table given as the base would count the same
   logs twice; the report warns).
7. Optional (``replace_drifted``): a path of a measured cell with a figure beyond the bound (rule 5)
   takes the logged figures alone (means, success rate and count), not the merge: the base's figures
   for it describe a deployment that is gone, and merged by counts they would outweigh the few logged
   requests of a path the table no longer chooses (seen only through exploration), so the two paths
   would be compared across the drift. Its drift report lists the logged figure as the merged one.
   No flip below the sample minimum still holds (rule 4 acts on the result).
8. Optional (``interference``): a LOCAL append-prefill slows the decode steps of *every* request on
   its decode worker, so a cell's own requests do not show what its LOCAL answer costs in TPOT (in a
   mix they share the decode batch with everyone else's, whichever path each took, and per-path means
   of the same cell hardly differ). Rule 8 reads that cost from the logs as a natural experiment: each
   evidence record with a TPOT (every turn, every cell) is exposed, over its decode interval
   ``[start + TTFT, start + E2E]``, to the Turn-2+ arrivals of each (cell, path) per second; a least-
   squares fit of the TPOTs on those rates, with one intercept per stretch of ``_TREND_S`` seconds (at
   most ``_TREND_BLOCKS`` stretches; a drift moves the level), gives each (cell, path) arrival's added
   TPOT. A cell's effect is ``(local coefficient - pd coefficient) x rate / mean TPOT``, ``rate``
   the Turn-2+ arrivals per second of all cells: the relative TPOT change were the whole load that
   cell's and going LOCAL rather than PD, which is what a sweep point of the cell measures
   (interference taken as linear in the load). A cell with at least ``_MIN_ARRIVALS`` arrivals on
   each path and an effect beyond ``z`` standard errors of the fit (rule 5's ``z``) gets its local TPOT
   ``pd TPOT x (1 + effect)`` after rules 3 and 7; rule 4 acts on the result. Exploration provides the
   arrivals of the path the table does not choose; Poisson arrivals provide the spread.

Memory: ``refresh_table`` reads ``records`` once and keeps each distinct record and a 16-byte digest
of it (the de-duplication set: one entry per distinct record, about 90 bytes in Python against the
record's own few hundred; a repeated or bad line adds nothing); ``refresh_command.py`` feeds it the
logs one bounded line at a time.

The rules stay one module: they act in one pass on the same per-cell rows, and the property tests
(order, sample minimum) hold the whole pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from decision_service.header import BIDIR_FIGURES, BIDIR_LATENCIES, LATENCIES, Figure, TableHeader, Weights
from decision_service.route import CellRule, Router, Verdict
from decision_service.table import Table, TableSpec, encode_table
from ppd.records import CLIENT_DISCONNECTED, client_caused
from table_builder.aggregate import CellKey, ModeFigures
from table_builder.build import axes_locator, bidir_figures, cell_row, iso_from_start_time
from table_builder.records import Record
from table_builder.refresh_report import CellDrift, DriftReport, FigureShift, Flip, HeldCell, z_for

__all__ = [
    "EVIDENCE_MODES",
    "REFRESH_VERSION",
    "RefreshResult",
    "refresh_table",
]

#: Goes into every refreshed table's provenance; bump when the rules change the bytes.
REFRESH_VERSION: Final = "table_builder.refresh/4"
#: Record modes whose Turn-2+ requests are evidence (rule 1); in a production log (no target_qps) only
#: ``ppd``.
EVIDENCE_MODES: Final = frozenset({"ppd", "pd", "local", "bidir"})
_LEFT_OUT_DISCONNECTED: Final = "client disconnected (no failure of the path)"
_LEFT_OUT_REFUSED: Final = "a worker refused the request itself (4xx: no failure of the path)"
_LEFT_OUT_DUPLICATE: Final = "duplicate line (the same request again)"
#: The paths evidence is filed under; a cell is measured (or filled) from the first two.
_PATHS: Final = ("pd", "local", "bidir")
_BASE_PATHS: Final = ("pd", "local")
_COLUMNS: Final = {
    "pd": (Figure.PD_TTFT_MS, Figure.PD_TPOT_MS, Figure.PD_SUCCESS, Figure.PD_SAMPLES),
    "local": (Figure.LOCAL_TTFT_MS, Figure.LOCAL_TPOT_MS, Figure.LOCAL_SUCCESS, Figure.LOCAL_SAMPLES),
    "bidir": BIDIR_FIGURES,
}
_CENSORED_TTFT_MS: Final = 30_000.0
_ROUNDING: Final = 1e-9
#: Rule 8: arrivals a cell needs on each path, and the trend's stretches.
_MIN_ARRIVALS: Final = 10
_TREND_S: Final = 20.0
_TREND_BLOCKS: Final = 50

Row = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class RefreshResult:
    spec: TableSpec
    drift: DriftReport

    def encode(self) -> bytes:
        return encode_table(self.spec)


@dataclass(slots=True)
class _PathEvidence:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    ok: int = 0
    sent: int = 0

    def add(self, r: Record, timeout_ms: float) -> bool:
        """Count ``r``; False when it completed with a latency beyond ``timeout_ms`` (rule 1), which
        counts as a request that did not complete."""
        self.sent += 1
        if r.ok and not _within(r, timeout_ms):
            return False
        if r.ok:
            self.ok += 1
            if r.ttft_ms is not None:
                self.ttft.append(r.ttft_ms)
            if r.tpot_ms is not None:
                self.tpot.append(r.tpot_ms)
        return True

    def figures(self) -> ModeFigures:
        return ModeFigures(
            ttft_ms=_mean(self.ttft),
            tpot_ms=_mean(self.tpot),
            success_rate=self.ok / self.sent,
            samples=len(self.ttft),
            sent=self.sent,
        )


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def _within(r: Record, timeout_ms: float) -> bool:
    """Rule 1: whether the request's TTFT and TPOT (where measured) lie within the timeout."""
    return all(v is None or v <= timeout_ms for v in (r.ttft_ms, r.tpot_ms))


def _distinct(records: Iterable[Record]) -> tuple[list[Record], int]:
    """Rule 1: each request once, in the order met, and how many lines repeated one. The set holds a
    16-byte digest per distinct record (what ``to_json`` writes), never a repeated or a left-out line's."""
    seen: set[bytes] = set()
    out: list[Record] = []
    repeated = 0
    for r in records:
        digest = hashlib.blake2b(r.to_json().encode(), digest_size=16).digest()
        if digest in seen:
            repeated += 1
        else:
            seen.add(digest)
            out.append(r)
    return out, repeated


@dataclass(frozen=True, slots=True)
class _Evidence:
    cells: Mapping[CellKey, Mapping[str, _PathEvidence]]
    used: int
    left_out: Mapping[str, int]
    #: Rule 1: evidence lines that completed with a latency beyond the timeout (counted as failures).
    beyond: int
    newest: float | None
    runs: tuple[str, ...]
    #: Rule 8: each Turn-2+ evidence record's cell, path and start; every evidence record's (start,
    #: decode start, decode end, TPOT) of any turn.
    located: tuple[tuple[CellKey, str, float], ...] = ()
    decodes: tuple[tuple[float, float, float, float], ...] = ()


def _not_evidence(r: Record) -> str:
    """Rule 1: why a record of the table's shape and model is no evidence of any turn ("" when it is)."""
    if r.mode not in EVIDENCE_MODES:
        return f"mode {r.mode} (evidence is ppd, pd, local and bidir)"
    if r.target_qps <= 0 and r.mode != "ppd":
        return f"mode {r.mode} in a production log (no target_qps: evidence there is ppd lines)"
    if not r.ok and r.error == CLIENT_DISCONNECTED:
        return _LEFT_OUT_DISCONNECTED
    if not r.ok and client_caused(r.error):
        return _LEFT_OUT_REFUSED
    return ""


def _not_decided(r: Record) -> str:
    """Rule 1: why an evidence record is none of the decision's ("" when it is)."""
    if r.turn < 2:
        return "turn 1 (always PD; not part of the decision)"
    if r.path not in _PATHS:
        return f"path {r.path}"
    return ""


def _decode(r: Record, timeout_ms: float) -> tuple[float, float, float, float] | None:
    """Rule 8: an evidence record's (start, decode start, decode end, TPOT), when it completed a
    decode within the timeout."""
    if not (r.ok and r.tpot_ms is not None and r.ttft_ms is not None and r.e2e_ms is not None):
        return None
    if not _within(r, timeout_ms) or r.e2e_ms <= r.ttft_ms:
        return None
    return r.start_time, r.start_time + r.ttft_ms / 1e3, r.start_time + r.e2e_ms / 1e3, r.tpot_ms


def _gather(
    records: Sequence[Record], header: TableHeader, qps_window_s: float, timeout_ms: float, repeated: int
) -> _Evidence:
    """Rules 1 and 2: file each evidence record in its cell and path."""
    locate = axes_locator(header.axes)
    left_out: Counter[str] = Counter({_LEFT_OUT_DUPLICATE: repeated} if repeated else {})
    ours: list[Record] = []
    for r in records:
        if r.shape == header.shape and r.model == header.model:
            ours.append(r)
        else:
            left_out[f"other shape/model ({r.shape}/{r.model})"] += 1
    # Arrival times of the unlabelled (production) records, for rule 2's rate.
    # Rule 2: conversations per second, the table's unit: a conversation arrives with its Turn 1.
    # A log of later turns only: each line stands for its own arrival.
    arrivals = sorted(r.start_time for r in ours if r.target_qps <= 0 and r.turn == 1) or sorted(
        r.start_time for r in ours if r.target_qps <= 0
    )
    cells: dict[CellKey, dict[str, _PathEvidence]] = {}
    used = 0
    runs: set[str] = set()
    located: list[tuple[CellKey, str, float]] = []
    decodes: list[tuple[float, float, float, float]] = []
    beyond = 0
    for r in ours:
        if why := _not_evidence(r):
            left_out[why] += 1
            continue
        if (decode := _decode(r, timeout_ms)) is not None:
            decodes.append(decode)
        if why := _not_decided(r):
            left_out[why] += 1
            continue
        if r.target_qps > 0:  # a benchmark run: its workload label may name the class it measured
            key = locate(n_ctx=r.n_ctx, n_in=r.n_in, n_out=r.n_out, qps=r.target_qps, workload=r.workload)
        else:  # production: where the decision service's classifier put it, whatever its label
            qps = _arrival_rate(arrivals, r.start_time, qps_window_s)
            key = locate(n_ctx=r.n_ctx, n_in=r.n_in, n_out=r.n_out, qps=qps)
        if not cells.setdefault(key, {}).setdefault(r.path, _PathEvidence()).add(r, timeout_ms):
            beyond += 1
        located.append((key, r.path, r.start_time))
        used += 1
        runs.add(r.run_id)
    for paths in cells.values():
        for ev in paths.values():
            ev.ttft.sort()
            ev.tpot.sort()
    newest = max((r.start_time for r in ours), default=None)
    return _Evidence(
        cells={k: cells[k] for k in sorted(cells)},
        used=used,
        left_out=dict(sorted(left_out.items())),
        beyond=beyond,
        newest=newest,
        runs=tuple(sorted(runs)),
        located=tuple(sorted(located)),
        decodes=tuple(sorted(decodes)),
    )


@dataclass(frozen=True, slots=True)
class _Interference:
    effect: float
    error: float


def _interference(evidence: _Evidence) -> dict[CellKey, _Interference]:
    """Rule 8's fit: per cell with both paths logged, its TPOT effect and standard error."""
    arrivals: dict[tuple[CellKey, str], list[float]] = {}
    for key, path, start in evidence.located:
        arrivals.setdefault((key, path), []).append(start)
    rows = evidence.decodes
    if not rows or not arrivals:
        return {}
    pairs = sorted(arrivals)
    first = min(rows[0][0], *(a[0] for a in arrivals.values()))
    span = max(*(r[0] for r in rows), *(a[-1] for a in arrivals.values())) - first
    if span <= 0:
        return {}
    stretch = max(_TREND_S, span / _TREND_BLOCKS)
    blocks = sorted({math.floor((r[0] - first) / stretch) for r in rows})
    column = {b: i for i, b in enumerate(blocks)}
    x = np.zeros((len(rows), len(blocks) + len(pairs)), dtype=np.float64)
    y = np.array([r[3] for r in rows], dtype=np.float64)
    for i, (start, begin, end, _) in enumerate(rows):
        x[i, column[math.floor((start - first) / stretch)]] = 1.0
        for j, pair in enumerate(pairs):
            times = arrivals[pair]
            x[i, len(blocks) + j] = (bisect_right(times, end) - bisect_left(times, begin)) / (end - begin)
    if len(rows) <= x.shape[1]:
        return {}
    beta, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ beta
    cov = float(residual @ residual) / (len(rows) - x.shape[1]) * np.linalg.pinv(x.T @ x)
    rate = len(evidence.located) / span
    scale = rate / float(np.mean(y)) if float(np.mean(y)) > 0 else 0.0
    index = {pair: len(blocks) + j for j, pair in enumerate(pairs)}
    out: dict[CellKey, _Interference] = {}
    for key in sorted({k for k, _ in pairs}):
        lo, pd = index.get((key, "local")), index.get((key, "pd"))
        if lo is None or pd is None or scale <= 0:
            continue
        if min(len(arrivals[key, "local"]), len(arrivals[key, "pd"])) < _MIN_ARRIVALS:
            continue
        var = float(cov[lo, lo] + cov[pd, pd] - 2.0 * cov[lo, pd])
        out[key] = _Interference(
            effect=float(beta[lo] - beta[pd]) * scale, error=math.sqrt(max(var, 0.0)) * scale
        )
    return out


def _arrival_rate(arrivals: Sequence[float], t: float, window_s: float) -> float:
    """Rule 2: arrivals per second in the ``window_s`` seconds centred on ``t``, the window moved inside
    the logs' span at its ends (so the first and last lines of a log are not undercounted); a log
    shorter than the window is counted over the window all the same."""
    first, last = arrivals[0], arrivals[-1]
    low = min(max(t - window_s / 2, first), max(last - window_s, first))
    return (bisect_right(arrivals, low + window_s) - bisect_left(arrivals, low)) / window_s


def _merge_path(  # noqa: PLR0917 (one path of one cell, and how to merge it)
    row: Row, path: str, ev: _PathEvidence, z: float, shifts: list[FigureShift], replace: bool
) -> None:
    """Rule 3 for one path of a measured base cell, in place; rule 5's tests appended to ``shifts``;
    with ``replace``, rule 7."""
    ttft_col, tpot_col, success_col, samples_col = _COLUMNS[path]
    base_sent = float(row[samples_col])
    base_ok = float(round(float(row[success_col]) * base_sent))
    found: list[FigureShift] = []
    merged: dict[Figure, float] = {}
    logged: dict[Figure, float] = {}
    for col, values in ((ttft_col, ev.ttft), (tpot_col, ev.tpot)):
        if not values:
            continue
        base = float(row[col])
        merged[col] = math.fsum([base * base_ok, *values]) / (base_ok + len(values))
        logged[col] = math.fsum(values) / len(values)
        if len(values) >= 2 and base_ok >= 1:
            error = statistics.stdev(values) * math.sqrt(1.0 / len(values) + 1.0 / base_ok)
            _test(found, Figure(col), base, logged[col], merged[col], len(values), error, z)
    base_rate = float(row[success_col])
    sent = base_sent + ev.sent
    merged[success_col] = (base_ok + ev.ok) / sent
    logged[success_col] = ev.ok / ev.sent
    if ev.sent >= 2:
        error = math.sqrt(
            merged[success_col] * (1.0 - merged[success_col]) * (1.0 / ev.sent + 1.0 / base_sent)
        )
        _test(
            found, Figure(success_col), base_rate, logged[success_col], merged[success_col], ev.sent, error, z
        )
    if replace and found:
        # Rule 7: the path drifted; its base figures are out of date, the logs alone stand for it.
        merged, sent = logged, float(ev.sent)
        found = [dataclasses.replace(f, merged=f.logged) for f in found]
    shifts.extend(found)
    for col, value in merged.items():
        row[col] = value
    row[samples_col] = sent


def _merge_paths(
    row: Row, paths: Mapping[str, _PathEvidence], z: float, replace: bool, timeout_ms: float
) -> tuple[list[FigureShift], str]:
    """Rule 3 (with rules 5 and 7) for every logged path of a measured base cell, in place; the shifts,
    and what ``_first_bidir`` censored."""
    shifts: list[FigureShift] = []
    censored = ""
    for path in _PATHS:
        if path not in paths:
            continue
        if path == "bidir" and row[Figure.BIDIR_SAMPLES] <= 0:
            censored = _first_bidir(row, paths[path], timeout_ms)
        else:
            _merge_path(row, path, paths[path], z, shifts, replace)
    return shifts, censored


def _first_bidir(row: Row, ev: _PathEvidence, timeout_ms: float) -> str:
    """Rule 3 for bidir evidence in a cell without BIDIR figures: the logged figures become them, in
    place (as ``build`` computes them from a ``bidir`` run); what was censored ("" when nothing)."""
    figures, censored = bidir_figures(ev.figures(), [float(x) for x in row], timeout_ms)
    if figures is not None:
        row[list(BIDIR_FIGURES)] = figures
    return censored


def _censored_note(label: str, censored: str, timeout_ms: float) -> str:
    return f"{label}: {censored} in the logs; its bidir TTFT is the timeout, {timeout_ms:g} ms"


def _test(  # noqa: PLR0917 (the figures of one test, in the order the report prints them)
    shifts: list[FigureShift],
    figure: Figure,
    base: float,
    logged: float,
    merged: float,
    n: int,
    error: float,
    z: float,
) -> None:
    """Rule 5: append the shift when ``logged`` lies beyond ``z`` standard errors of ``base``."""
    gap = abs(logged - base)
    # A gap within float rounding of the means is none (identical values summed in another order).
    if gap <= _ROUNDING * max(abs(base), abs(logged)) or (error > 0 and gap / error <= z):
        return
    score = gap / error if error > 0 else None
    shifts.append(
        FigureShift(figure=figure.label, base=base, logged=logged, merged=merged, logged_samples=n, z=score)
    )


def _path(v: Verdict) -> str:
    return "bidir" if v.bidir else "local" if v.local else "pd"


def _answers(router: Router, rule: CellRule, weights: Sequence[Weights]) -> tuple[str, ...]:
    """The cell's answer under each weights, as ``Router.route`` gives it without live signals: ``pd`` or
    ``local``; where the cell has BIDIR figures and a caller that can serve BIDIR is answered otherwise,
    ``"<that answer> (without bidir: <the two-path one>)"``."""
    out = []
    for w in weights:
        if rule.forced is not None:
            local = rule.forced[0]
        else:
            local = w.w_ttft * rule.delta_ttft - w.w_tpot * rule.delta_tpot > 0
        plain = "local" if local else "pd"
        capable = router.capable_verdict(rule, w)
        three = plain if capable is None else _path(capable)
        out.append(plain if three == plain else f"{three} (without bidir: {plain})")
    return tuple(out)


def _label(header: TableHeader, key: CellKey) -> str:
    axes = header.axes
    level = axes.qps_levels[key.qps]
    return f"{axes.context_classes[key.context]}/{axes.workloads[key.workload].name}@{level:g}"


@dataclass(slots=True)
class _Candidates:
    """Rule 3's outcome: a merged row per cell with evidence, and what the report says about them."""

    rows: dict[CellKey, Row] = field(default_factory=dict)
    logged: dict[CellKey, int] = field(default_factory=dict)
    drifted: list[CellDrift] = field(default_factory=list)
    filled: list[CellKey] = field(default_factory=list)
    one_path: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    interference: dict[str, float] = field(default_factory=dict)


def _candidates(  # noqa: PLR0917 (the evidence and each option of the refresh)
    base: Table, evidence: _Evidence, z: float, replace: bool, interference: bool, timeout_ms: float
) -> _Candidates:
    header = base.header
    out = _Candidates()
    effects = _interference(evidence) if interference else {}
    for key, paths in evidence.cells.items():
        out.logged[key] = sum(ev.sent for ev in paths.values())
        label = _label(header, key)
        if base.measured(key.context, key.workload, key.qps):
            row = np.array(base.figures[key.context, key.workload, key.qps], dtype=np.float64)
            shifts, censored = _merge_paths(row, paths, z, replace, timeout_ms)
            if censored:
                out.notes.append(_censored_note(label, censored, timeout_ms))
            if shifts:
                out.drifted.append(CellDrift(cell=label, shifts=tuple(shifts)))
            fit = effects.get(key)
            if fit is not None and fit.effect > -1.0 and abs(fit.effect) > z * fit.error:
                # Rule 8: the local path's TPOT as the cell's traffic alone would cost it.
                row[Figure.LOCAL_TPOT_MS] = row[Figure.PD_TPOT_MS] * (1.0 + fit.effect)
                out.interference[label] = fit.effect
            latencies = [*LATENCIES, *(BIDIR_LATENCIES if row[Figure.BIDIR_SAMPLES] > 0 else ())]
            if (row[latencies] <= 0).any():
                out.notes.append(f"{label}: logged latencies of 0 ms would zero a figure; base figures kept")
            else:
                out.rows[key] = row
        elif not all(p in paths for p in _BASE_PATHS):
            out.one_path.append(label)
        else:
            fresh, _, _ = cell_row(paths["pd"].figures(), paths["local"].figures(), timeout_ms)
            if fresh is not None:
                row = np.array(fresh, dtype=np.float64)
                if "bidir" in paths and (censored := _first_bidir(row, paths["bidir"], timeout_ms)):
                    out.notes.append(_censored_note(label, censored, timeout_ms))
                out.rows[key] = row
                out.filled.append(key)
    return out


@dataclass(frozen=True, slots=True)
class _Change:
    """One cell whose answers differ from the base's, and the cell its new answer is read from."""

    cell: CellKey
    source: CellKey
    before: tuple[str, ...]
    after: tuple[str, ...]
    reason: str


def _changes(old: Router, new: Router, weights: Sequence[Weights]) -> list[_Change]:
    axes = old.table.header.axes
    nc, nw, nq = axes.shape
    out = []
    for c in range(nc):
        for w in range(nw):
            for q in range(nq):
                before, after = old.cell(c, w, q), new.cell(c, w, q)
                a, b = _answers(old, before, weights), _answers(new, after, weights)
                if a != b:
                    source = CellKey(c, w, axes.qps_levels.index(after.qps_level))
                    out.append(_Change(CellKey(c, w, q), source, a, b, after.verdict.reason.name))
    return out


def _hold(
    base: Table, cands: _Candidates, min_samples: int
) -> tuple[npt.NDArray[np.float64], list[_Change], dict[CellKey, int]]:
    """Rule 4: drop the candidates whose evidence would flip an answer on too few samples, until none
    does (dropping a cell can only take away a nearest-level source, so this ends)."""
    header = base.header
    weights = [header.default_weights, *(w for _, w in sorted(header.profiles.items()))]
    old = Router(base)
    held: dict[CellKey, int] = {}
    while True:
        figures = np.array(base.figures, dtype=np.float64)
        for key, row in cands.rows.items():
            figures[key.context, key.workload, key.qps] = row
        changes = _changes(old, Router(Table.from_bytes(encode_table(TableSpec(header, figures)))), weights)
        weak = {
            ch.source
            for ch in changes
            if cands.logged.get(ch.source, 0) < min_samples and ch.source in cands.rows
        }
        if not weak:
            return figures, changes, held
        for key in weak:
            del cands.rows[key]
            held[key] = cands.logged[key]


def refresh_table(
    base: Table,
    records: Iterable[Record],
    *,
    min_samples: int,
    confidence: float,
    qps_window_s: float = 10.0,
    replace_drifted: bool = False,
    interference: bool = False,
    timeout_ms: float | None = None,
) -> RefreshResult:
    """Merge the logged evidence in ``records`` into ``base`` (module rules 1-6; with
    ``replace_drifted``, rule 7; with ``interference``, rule 8).

    ``qps_window_s``: rule 2's window for records without a target QPS. ``timeout_ms``: rule 1's
    bound on a logged TTFT or TPOT (None: the base's benchmark timeout, ``censored_ttft_ms``).
    ``records`` is read once, in one pass, keeping each distinct record (rule 1).
    """
    if min_samples < 1:
        raise ValueError(f"min_samples must be >= 1, got {min_samples}")
    if not (math.isfinite(qps_window_s) and qps_window_s > 0):
        raise ValueError(f"qps_window_s must be a positive number of seconds, got {qps_window_s}")
    header = base.header
    if timeout_ms is None:
        timeout_ms = float(header.provenance.get("censored_ttft_ms", _CENSORED_TTFT_MS))
    if not (math.isfinite(timeout_ms) and timeout_ms > 0):
        raise ValueError(f"timeout_ms must be a positive number of milliseconds, got {timeout_ms}")
    z = z_for(confidence)
    records, repeated = _distinct(records)
    evidence = _gather(records, header, qps_window_s, timeout_ms, repeated)
    cands = _candidates(base, evidence, z, replace_drifted, interference, timeout_ms)
    figures, changes, held = _hold(base, cands, min_samples)
    names = sorted(header.profiles)
    flips = tuple(
        Flip(
            cell=_label(header, ch.cell),
            before=ch.before[0],
            after=ch.after[0],
            reason=ch.reason,
            profiles=tuple(n for n, x, y in zip(names, ch.before[1:], ch.after[1:], strict=True) if x != y),
            source=_label(header, ch.source),
            logged=cands.logged.get(ch.source, 0),
        )
        for ch in changes
    )
    merged = sum(
        1
        for k, row in cands.rows.items()
        if not np.array_equal(row, base.figures[k.context, k.workload, k.qps])
    )
    notes = list(cands.notes)
    if evidence.beyond:
        notes.append(
            f"{evidence.beyond} logged request(s) with a TTFT or TPOT beyond the {timeout_ms:g} ms timeout "
            "counted as failures (not completed in time), their latencies left out"
        )
    if header.provenance.get("source") == "refresh":
        notes.append(
            "the base is itself a refreshed table: logs already merged into it are counted again; "
            "refresh the offline-built table instead"
        )
    report = DriftReport(
        key=header.key,
        base_version=base.version,
        min_samples=min_samples,
        confidence=confidence,
        z=z,
        used=evidence.used,
        left_out=evidence.left_out,
        cells_with_evidence=len(evidence.cells),
        merged=merged,
        filled=tuple(_label(header, k) for k in cands.filled if k not in held),
        one_path_only=tuple(cands.one_path),
        drifted=tuple(cands.drifted),
        flips=flips,
        held=tuple(HeldCell(cell=_label(header, k), logged=n) for k, n in sorted(held.items())),
        notes=tuple(notes),
    )
    new_header = _provenance(base, records, evidence, report, qps_window_s, timeout_ms, replace_drifted)
    if interference:  # absent when off: the bytes of a plain refresh are unchanged
        provenance = dict(new_header.provenance)
        provenance["interference"] = dict(sorted(cands.interference.items()))
        new_header = dataclasses.replace(new_header, provenance=provenance)
    return RefreshResult(spec=TableSpec(new_header, figures), drift=report)


def _provenance(  # noqa: PLR0917 (what the provenance records)
    base: Table,
    records: Sequence[Record],
    evidence: _Evidence,
    report: DriftReport,
    qps_window_s: float,
    timeout_ms: float,
    replace_drifted: bool,
) -> TableHeader:
    digest = hashlib.sha256()
    for line in sorted(r.to_json() for r in records):
        digest.update(line.encode())
        digest.update(b"\n")
    provenance: dict[str, Any] = {
        "source": "refresh",
        "refresh": REFRESH_VERSION,
        "base": {"version": base.version, "provenance": dict(base.header.provenance)},
        "logs_sha256": digest.hexdigest(),
        "runs": list(evidence.runs),
        "newest_start_time": evidence.newest,
        "min_samples": report.min_samples,
        "confidence": report.confidence,
        "qps_window_s": qps_window_s,
        "timeout_ms": timeout_ms,
        "cells": report.counts(),
        "left_out": dict(report.left_out),
        "flipped_cells": [f.cell for f in report.flips],
        "held_cells": [h.cell for h in report.held],
    }
    if replace_drifted:  # absent when off: the bytes of a plain refresh are unchanged
        provenance["replace_drifted"] = True
    built_at = iso_from_start_time(evidence.newest)
    if built_at is not None:
        provenance["built_at"] = built_at
    return dataclasses.replace(base.header, provenance=provenance)

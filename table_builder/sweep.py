"""The table-building job: run a grid (shape x mode x workload x QPS), keep the records, build a table.

Rules:

1. One grid point = one static-mode run of one synthetic workload at one QPS level, produced by an
   :class:`Engine`. Its records go to ``<out>/records/<shape>/<mode>/<workload>_<qps>.jsonl``, written
   atomically when the point finishes, so a point file is either complete or absent.
2. Resumable: a rerun skips every point whose file exists and reads back cleanly; an interrupted point
   simply runs again. ``<out>/sweep.json`` records the engine settings; a rerun with different settings
   is refused instead of mixing two experiments in one table.
3. Deterministic: each point is seeded from (seed, point id), so the records, and therefore the table
   bytes, do not depend on the order points run in, on ``jobs``, or on interruptions.
4. The table is built from the point files of that shape only and published atomically.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from ppd.catalog import Workload
from table_builder.records import Record, scan_records, write_records

__all__ = [
    "MANIFEST",
    "Engine",
    "GridPoint",
    "SweepError",
    "SweepPlan",
    "point_path",
    "run_sweep",
]

logger = logging.getLogger(__name__)

MANIFEST: Final = "sweep.json"


class SweepError(RuntimeError):
    """The sweep cannot go on as asked (settings differ from the folder's, an engine failed)."""


@dataclass(frozen=True, slots=True, order=True)
class GridPoint:
    """One static-mode run of one workload at one QPS level."""

    shape: str
    model: str
    mode: str
    workload: Workload
    qps: float

    @property
    def run_id(self) -> str:
        return f"{self.shape}_{self.mode}_{self.workload.name}_{self.qps:g}"


class Engine(Protocol):
    """Produces the records of one grid point. Must be picklable (points run in worker processes)."""

    @property
    def name(self) -> str: ...

    def settings(self) -> Mapping[str, Any]:
        """Everything that changes the records (seed, duration, calibration, ...), JSON-serialisable."""
        ...

    def run(self, point: GridPoint) -> list[Record]: ...


@dataclass(frozen=True, slots=True)
class SweepPlan:
    shapes: tuple[str, ...]
    model: str
    modes: tuple[str, ...]
    workloads: tuple[Workload, ...]
    qps_levels: tuple[float, ...]

    def points(self) -> list[GridPoint]:
        return [
            GridPoint(shape, self.model, mode, workload, qps)
            for shape in self.shapes
            for workload in self.workloads
            for qps in self.qps_levels
            for mode in self.modes
        ]


def point_path(out: Path, point: GridPoint) -> Path:
    return out / "records" / point.shape / point.mode / f"{point.workload.name}_{point.qps:g}.jsonl"


def _finished(path: Path) -> bool:
    if not path.is_file():
        return False
    _, problems = scan_records(path)
    if problems:
        logger.warning("%s is damaged (%s); running the point again", path, problems[0])
        return False
    return True


def _check_manifest(out: Path, engine: Engine, model: str) -> None:
    manifest = out / MANIFEST
    wanted = {"engine": engine.name, "model": model, "settings": dict(engine.settings())}
    canonical = json.loads(json.dumps(wanted, sort_keys=True))
    if manifest.exists():
        found = json.loads(manifest.read_text(encoding="utf-8"))
        if found != canonical:
            raise SweepError(
                f"{out} holds a sweep with other settings ({json.dumps(found, sort_keys=True)}); "
                f"this one is {json.dumps(canonical, sort_keys=True)}: use another --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(canonical, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, manifest)


def _run_point(engine: Engine, point: GridPoint, path: Path) -> GridPoint:
    records = engine.run(point)
    write_records(path, records)
    return point


def run_sweep(
    plan: SweepPlan,
    engine: Engine,
    out: Path,
    *,
    jobs: int = 1,
    progress: Callable[[int, int], Any] | None = None,
    advance: Callable[[GridPoint], None] | None = None,
) -> dict[str, list[Path]]:
    """Run every unfinished point of ``plan``; return the point files per shape (finished and new).

    ``progress(done, total)`` is called once before work starts; ``advance(point)`` after each point.
    """
    _check_manifest(out, engine, plan.model)
    for stale in out.glob("records/**/.*.tmp"):
        stale.unlink()
    points = plan.points()
    todo = [p for p in points if not _finished(point_path(out, p))]
    if progress is not None:
        progress(len(points) - len(todo), len(points))
    if jobs <= 1:
        for p in todo:
            _run_point(engine, p, _prepare(out, p))
            if advance is not None:
                advance(p)
    elif todo:
        _run_parallel(engine, todo, out, jobs, advance)
    files: dict[str, list[Path]] = {}
    for p in points:
        files.setdefault(p.shape, []).append(point_path(out, p))
    return files


def _prepare(out: Path, point: GridPoint) -> Path:
    path = point_path(out, point)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _run_parallel(
    engine: Engine,
    todo: Sequence[GridPoint],
    out: Path,
    jobs: int,
    advance: Callable[[GridPoint], None] | None,
) -> None:
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        pending: set[Future[GridPoint]] = {pool.submit(_run_point, engine, p, _prepare(out, p)) for p in todo}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    point = future.result()
                    if advance is not None:
                        advance(point)
        except BaseException:
            for future in pending:
                future.cancel()
            raise

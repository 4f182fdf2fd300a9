"""Reader for the paper artifact's result folders (github.com/freelulul/vllm-ppd, ``results/comprehensive``).

Layout: ``<root>/<config>/<config>_<turn1>_<class>_<qps>.json``, one file per benchmark point, e.g.
``1P_3D/1P_3D_large_mid_paste_8.json``. Each file holds Turn-2 means (``turn2.avg_ttft_ms``,
``turn2.avg_tpot_ms``, ``turn2.count`` completed Turn-2 requests), ``success_rate`` in percent over
``total_requests`` sent.

Rules:

1. Configs come in pairs: the PD shape ``1P_3D`` is the static ``pd`` mode of shape ``1P3D``, the
   local-capable ``1P_3pD`` its static ``local`` mode (likewise 2P_2D/2P_2pD, 3P_1D/3P_1pD). Any other
   config folder (e.g. the artifact's mixed ``1P_1D_2pD``) is listed as ignored, with the reason.
2. A point with ``turn2.count == 0`` has no latency figures (the artifact writes zeros there): its means
   are ``None``, never 0 ms.
3. Every file that cannot be read (bad JSON, missing or mistyped key, a name that disagrees with the
   contents, an unknown workload) is a problem with its path; :func:`read_artifact` raises
   :class:`ArtifactError` listing them all. Nothing is skipped silently.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ppd.catalog import Workload, parse_workload

__all__ = [
    "CONFIG_MODES",
    "ArtifactError",
    "ArtifactPoint",
    "ArtifactProblem",
    "ArtifactScan",
    "read_artifact",
    "scan_artifact",
]

#: Artifact config folder -> (our deployment shape, static mode).
CONFIG_MODES: Final[Mapping[str, tuple[str, str]]] = {
    "1P_3D": ("1P3D", "pd"),
    "1P_3pD": ("1P3D", "local"),
    "2P_2D": ("2P2D", "pd"),
    "2P_2pD": ("2P2D", "local"),
    "3P_1D": ("3P1D", "pd"),
    "3P_1pD": ("3P1D", "local"),
}


@dataclass(frozen=True, slots=True)
class ArtifactPoint:
    """The Turn-2 figures of one artifact result file."""

    source: str
    config: str
    shape: str
    mode: str
    workload: Workload
    qps: float
    ttft_ms: float | None
    tpot_ms: float | None
    samples: int
    sent: int
    success_rate: float
    #: The run's own ``timestamp`` field (ISO 8601), when it has one.
    timestamp: str | None = None


@dataclass(frozen=True, slots=True)
class ArtifactProblem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True, slots=True)
class ArtifactScan:
    points: tuple[ArtifactPoint, ...]
    problems: tuple[ArtifactProblem, ...]
    #: (path, reason) of folders and files that are not part of a PD / local pair.
    ignored: tuple[tuple[str, str], ...]


class ArtifactError(ValueError):
    """Artifact files that could not be read; ``problems`` lists each with its path."""

    def __init__(self, problems: Iterable[ArtifactProblem]) -> None:
        self.problems = tuple(problems)
        shown = "\n".join(f"  {p}" for p in self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        super().__init__(f"{len(self.problems)} bad artifact file(s):\n{shown}{more}")


class _BadFileError(ValueError):
    pass


def _number(obj: Mapping[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadFileError(f"{where}{key} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _BadFileError(f"{where}{key} must be finite and >= 0, got {value!r}")
    return float(value)


def _count(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < 0:
        raise _BadFileError(f"{where}{key} must be a non-negative integer, got {value!r}")
    return value


def _parse_name(config: str, stem: str) -> tuple[Workload, float]:
    prefix = f"{config}_"
    if not stem.startswith(prefix):
        raise _BadFileError(f"file name does not start with its folder's config {config!r}")
    workload_name, sep, qps_text = stem.removeprefix(prefix).rpartition("_")
    if not sep:
        raise _BadFileError("file name is not <config>_<turn1>_<class>_<qps>.json")
    try:
        qps = float(qps_text)
    except ValueError:
        raise _BadFileError(f"QPS {qps_text!r} in the file name is not a number") from None
    if not (math.isfinite(qps) and qps > 0):
        raise _BadFileError(f"QPS {qps_text!r} in the file name must be > 0")
    try:
        workload = parse_workload(workload_name)
    except ValueError as exc:
        raise _BadFileError(str(exc)) from None
    return workload, qps


def _read_point(path: Path, root: Path, config: str) -> ArtifactPoint:
    shape, mode = CONFIG_MODES[config]
    workload, qps = _parse_name(config, path.stem)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise _BadFileError(f"not UTF-8 text: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise _BadFileError(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise _BadFileError("expected a JSON object")
    if "config" in obj and obj["config"] != config:
        raise _BadFileError(f"config {obj['config']!r} inside disagrees with the folder {config!r}")
    if "workload" in obj and obj["workload"] != workload.name:
        raise _BadFileError(
            f"workload {obj['workload']!r} inside disagrees with the file name {workload.name!r}"
        )
    if "qps" in obj and _number(obj, "qps", "") != qps:
        raise _BadFileError(f"qps {obj['qps']!r} inside disagrees with the file name ({qps:g})")
    turn2 = obj.get("turn2")
    if not isinstance(turn2, dict):
        raise _BadFileError("turn2 must be an object with count, avg_ttft_ms, avg_tpot_ms")
    samples = _count(turn2, "count", "turn2.")
    ttft = _number(turn2, "avg_ttft_ms", "turn2.")
    tpot = _number(turn2, "avg_tpot_ms", "turn2.")
    success_pct = _number(obj, "success_rate", "")
    if success_pct > 100:
        raise _BadFileError(f"success_rate is a percentage, got {success_pct!r}")
    sent = _count(obj, "total_requests", "") if "total_requests" in obj else samples
    if sent < samples:
        raise _BadFileError(f"total_requests ({sent}) is smaller than turn2.count ({samples})")
    timestamp = obj.get("timestamp")
    if timestamp is not None and not isinstance(timestamp, str):
        raise _BadFileError(f"timestamp must be a string, got {timestamp!r}")
    return ArtifactPoint(
        source=path.relative_to(root).as_posix(),
        config=config,
        shape=shape,
        mode=mode,
        workload=workload,
        qps=qps,
        ttft_ms=ttft if samples else None,
        tpot_ms=tpot if samples else None,
        samples=samples,
        sent=sent,
        success_rate=success_pct / 100.0,
        timestamp=timestamp,
    )


def _refuse_constant(name: str) -> Any:
    raise _BadFileError(f"{name} is not a valid number")


def scan_artifact(root: str | os.PathLike[str]) -> ArtifactScan:
    """Every result file under ``root`` (the folder holding the config folders), in sorted order."""
    base = Path(root)
    if not base.is_dir():
        raise NotADirectoryError(f"{base}: not a folder of artifact config folders")
    points: list[ArtifactPoint] = []
    problems: list[ArtifactProblem] = []
    ignored: list[tuple[str, str]] = []
    for entry in sorted(base.iterdir()):
        rel = entry.relative_to(base).as_posix()
        if not entry.is_dir():
            ignored.append((rel, "not a config folder"))
            continue
        if entry.name not in CONFIG_MODES:
            ignored.append((rel, "config is not one of the PD / local pairs " + ", ".join(CONFIG_MODES)))
            continue
        for path in sorted(entry.iterdir()):
            if path.suffix != ".json" or not path.is_file():
                ignored.append((path.relative_to(base).as_posix(), "not a .json result file"))
                continue
            try:
                points.append(_read_point(path, base, entry.name))
            except _BadFileError as exc:
                problems.append(ArtifactProblem(path.relative_to(base).as_posix(), str(exc)))
    return ArtifactScan(tuple(points), tuple(problems), tuple(ignored))


def read_artifact(roots: Iterable[str | os.PathLike[str]]) -> ArtifactScan:
    """Like :func:`scan_artifact` over several roots; raises :class:`ArtifactError` on any bad file."""
    points: list[ArtifactPoint] = []
    problems: list[ArtifactProblem] = []
    ignored: list[tuple[str, str]] = []
    for root in roots:
        scan = scan_artifact(root)
        points.extend(scan.points)
        problems.extend(scan.problems)
        ignored.extend(scan.ignored)
    if problems:
        raise ArtifactError(problems)
    return ArtifactScan(tuple(points), (), tuple(ignored))

"""The real-vLLM section of the report: pd / local / ppd measured on real vLLM workers.

Reads a folder written by ``ppd-vllm ppd-effect``: ``real_vllm.json`` (``RealVllmManifest``: engine,
model, profile, cores, seed, workload, capacity, the runs with the machine's load when each started)
and ``runs/*.jsonl``. Figures per load level and mode: Turn 2+ TTFT mean and P90, TPOT mean, success,
the local share of Turn 2+ requests; and the verdict the issue expects (ppd's Turn 2+ TTFT below pd's
with TPOT within +15%).

Rule 1: pure figures (``mode_figures``) over successful requests, success over all requests sent; a
        figure with no samples is None ("-" in the table).
Rule 2: every table and the PNG name engine, profile, seed and workload.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from loadgen.report.section import md_table, ms, save_png
from loadgen.summary import percentile
from table_builder.records import Record, read_records

__all__ = [
    "MANIFEST_NAME",
    "TPOT_TOLERANCE",
    "ModeFigures",
    "RealRun",
    "RealVllmManifest",
    "load_real_vllm",
    "mode_figures",
    "real_vllm_section",
    "verdict",
]

MANIFEST_NAME: Final = "real_vllm.json"
#: ppd may cost this much TPOT over pd (relative) and still pass (the issue's +15%).
TPOT_TOLERANCE: Final = 0.15
_MODES: Final = ("pd", "local", "ppd")
_COLOURS: Final = {"pd": "tab:blue", "local": "tab:orange", "ppd": "tab:green"}


@dataclass(frozen=True, slots=True)
class ModeFigures:
    sent: int
    success: float
    ttft_mean_ms: float | None
    ttft_p90_ms: float | None
    tpot_mean_ms: float | None
    #: Share of successful Turn 2+ requests that took the local path.
    local_share: float | None


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def mode_figures(records: Sequence[Record]) -> ModeFigures:
    """Turn 2+ TTFT (mean, P90), TPOT mean, success and local share of one run's records (rule 1)."""
    good = [r for r in records if r.ok]
    later = [r for r in good if r.turn > 1]
    ttfts = [r.ttft_ms for r in later if r.ttft_ms is not None]
    return ModeFigures(
        sent=len(records),
        success=len(good) / len(records) if records else 0.0,
        ttft_mean_ms=_mean(ttfts),
        ttft_p90_ms=percentile(ttfts, 90),
        tpot_mean_ms=_mean([r.tpot_ms for r in good if r.tpot_ms is not None]),
        local_share=sum(r.path == "local" for r in later) / len(later) if later else None,
    )


@dataclass(frozen=True, slots=True)
class RealRun:
    run_id: str
    level: str
    mode: str
    qps: float
    #: /proc/loadavg (1, 5, 15 min) when the run started: the machine is shared.
    load_average: str


@dataclass(frozen=True, slots=True)
class RealVllmManifest:
    engine: str
    model: str
    profile: str
    topology: str
    cores: dict[str, str]
    seed: int
    workload: str
    duration_s: float
    timeout_s: float
    capacity_qps: float
    capacity_measured: bool
    probe: tuple[tuple[float, float | None, float | None], ...]
    table: str
    runs: tuple[RealRun, ...]
    #: The ShareGPT pool the runs drew from (``loadgen.sharegpt.sharegpt_pool``), so that the very same
    #: conversations can be sent elsewhere (``ppd-bench sim-vs-real``).
    turns: int | None = 4
    max_output_tokens: int = 128
    max_context_tokens: int = 3000
    conversations: int = 400

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RealVllmManifest:
        raw: dict[str, Any] = json.loads(text)
        try:
            return cls(
                engine=str(raw["engine"]),
                model=str(raw["model"]),
                profile=str(raw["profile"]),
                topology=str(raw["topology"]),
                cores={str(k): str(v) for k, v in dict(raw["cores"]).items()},
                seed=int(raw["seed"]),
                workload=str(raw["workload"]),
                duration_s=float(raw["duration_s"]),
                timeout_s=float(raw["timeout_s"]),
                capacity_qps=float(raw["capacity_qps"]),
                capacity_measured=bool(raw["capacity_measured"]),
                probe=tuple((float(q), s, t) for q, s, t in raw["probe"]),
                table=str(raw["table"]),
                runs=tuple(RealRun(**run) for run in raw["runs"]),
                turns=None if raw.get("turns", 4) is None else int(raw.get("turns", 4)),
                max_output_tokens=int(raw.get("max_output_tokens", 128)),
                max_context_tokens=int(raw.get("max_context_tokens", 3000)),
                conversations=int(raw.get("conversations", 400)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{MANIFEST_NAME}: {exc}") from None

    def caption(self) -> str:
        return (
            f"engine {self.engine}; profile {self.profile}; model {self.model}; {self.topology}; "
            f"seed {self.seed}; workload {self.workload}"
        )


def verdict(pd: ModeFigures, ppd: ModeFigures) -> str:
    """Whether ppd's Turn 2+ TTFT mean is below pd's with its TPOT mean within +15% of pd's."""
    if pd.ttft_mean_ms is None or ppd.ttft_mean_ms is None or pd.tpot_mean_ms is None:
        return "n/a (no samples)"
    if ppd.tpot_mean_ms is None:
        return "n/a (no ppd TPOT)"
    ttft = ppd.ttft_mean_ms / pd.ttft_mean_ms - 1
    tpot = ppd.tpot_mean_ms / pd.tpot_mean_ms - 1
    ok = ttft < 0 and tpot <= TPOT_TOLERANCE
    return f"{'PASS' if ok else 'FAIL'} (TTFT {100 * ttft:+.0f}%, TPOT {100 * tpot:+.0f}%)"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def load_real_vllm(folder: Path) -> tuple[RealVllmManifest, dict[str, list[Record]]]:
    """The manifest and each run's records (by run id) of a ``ppd-vllm ppd-effect`` folder."""
    manifest = RealVllmManifest.from_json((folder / MANIFEST_NAME).read_text("utf-8"))
    records = {run.run_id: read_records([folder / "runs" / f"{run.run_id}.jsonl"]) for run in manifest.runs}
    return manifest, records


def real_vllm_section(folder: Path, out: Path) -> list[str]:
    """The section's Markdown lines; draws ``real_vllm.png`` into ``out``."""
    manifest, records = load_real_vllm(folder)
    figures = {run.run_id: mode_figures(records[run.run_id]) for run in manifest.runs}
    by_level: dict[str, dict[str, tuple[RealRun, ModeFigures]]] = {}
    for run in manifest.runs:
        by_level.setdefault(run.level, {})[run.mode] = (run, figures[run.run_id])
    rows, verdicts = [], []
    for level, modes in sorted(by_level.items(), key=lambda kv: next(iter(kv[1].values()))[0].qps):
        for mode in _MODES:
            if mode not in modes:
                continue
            run, fig = modes[mode]
            rows.append(
                [
                    level, f"{run.qps:g}", mode, str(fig.sent), _pct(fig.success), ms(fig.ttft_mean_ms),
                    ms(fig.ttft_p90_ms), ms(fig.tpot_mean_ms), _pct(fig.local_share), run.load_average,
                ]
            )  # fmt: skip
        if "pd" in modes and "ppd" in modes:
            verdicts.append([level, f"{modes['pd'][0].qps:g}", verdict(modes["pd"][1], modes["ppd"][1])])
    capacity = (
        f"{manifest.capacity_qps:g} QPS, measured by a pd ramp "
        + ", ".join(f"{q:g}: {_pct(s)} ok, {ms(t)} ms" for q, s, t in manifest.probe)
        if manifest.capacity_measured
        else f"{manifest.capacity_qps:g} QPS (given)"
    )
    cores = ", ".join(f"{wid} on cores {c}" for wid, c in sorted(manifest.cores.items())) or "unpinned"
    lines = [
        "## PPD on real vLLM",
        "",
        f"What was run: {manifest.caption()}.",
        f"Workers: {cores}; the gateway, the decision service and the load generator float over every "
        "core, and all processes share the memory bandwidth (so P's prefills can still slow D a little).",
        f"{manifest.duration_s:g} s of Poisson arrivals per run, {manifest.timeout_s:g} s request timeout; "
        f"capacity {capacity}. Every mode of a level sends the same conversations at the same offsets, "
        f"with fresh conversation ids and a per-run text mark (no run hits the prefix caches another "
        f"filled). {manifest.table}.",
        "",
        *md_table(
            [
                "level",
                "QPS",
                "mode",
                "requests",
                "success",
                "Turn 2+ TTFT mean ms",
                "P90 ms",
                "TPOT mean ms",
                "local share",
                "load avg",
            ],
            rows,
        ),
        f"Expected: ppd's Turn 2+ TTFT below pd's with TPOT within +{100 * TPOT_TOLERANCE:.0f}%.",
        "",
        *md_table(["level", "QPS", "ppd vs pd"], verdicts),
    ]
    _draw(manifest, by_level, out)
    lines += ["![PPD on real vLLM](real_vllm.png)", ""]
    return lines


def _draw(
    manifest: RealVllmManifest, by_level: dict[str, dict[str, tuple[RealRun, ModeFigures]]], out: Path
) -> None:
    def draw(axes: Any) -> None:
        for mode in _MODES:
            pts = sorted((modes[mode][0].qps, modes[mode][1]) for modes in by_level.values() if mode in modes)
            for ax, pick in zip(axes, ("ttft_mean_ms", "tpot_mean_ms"), strict=True):
                xs = [q for q, f in pts if getattr(f, pick) is not None]
                ys = [getattr(f, pick) for _, f in pts if getattr(f, pick) is not None]
                ax.plot(xs, ys, marker="o", label=mode, color=_COLOURS[mode])
        axes[0].set(xlabel="QPS", ylabel="Turn 2+ TTFT mean (ms)")
        axes[1].set(xlabel="QPS", ylabel="TPOT mean (ms)")
        axes[0].legend()

    out.mkdir(parents=True, exist_ok=True)
    save_png(out / "real_vllm.png", "PPD on real vLLM", manifest.caption(), draw, panels=2)

"""Calibration: the paper's interference micro-benchmark and KV transfer figures, in virtual time.

The micro-benchmark (docs/emulator-model.md 3.1): B decode requests share a warmed 2,048-token prefix
(a few own tokens each, 64 output tokens, ``ignore_eos``); N "full" prefills (1,024 unrelated tokens)
or N "append" prefills (1,024 new tokens on the shared prefix) join them. All B + N requests are
admitted one every δ (decodes first). The figure is the mean decode TPOT, (e2e − TTFT) / 63, against
a decode-only run. The profile runs with cascade attention on (section 3.3).

Targets, tolerances and the benchmark settings are data: ``simulator/tools/calibration/targets.json``.
The raw check replays the January-2026 configuration (its own settings in the same file) and compares
the absolute mean decode TPOT with ``paper_jan2026_tpot.json`` (the paper artifact's January-2026 raw
results, summarised; docs/emulator-model.md 3.1) for several batch sizes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, TextIO

from simulator.core.engine import Engine, EngineConfig, EngineRequest
from simulator.core.kv_cache import PrefixedBlocks, StreamBlocks
from simulator.core.link import Link, TransferMode
from simulator.core.profile import Profile, load_profile
from simulator.core.virtual import run_engine

__all__ = [
    "Figure",
    "Microbench",
    "interference_figures",
    "kv_transfer_figures",
    "load_targets",
    "mean_decode_tpot",
    "raw_figures",
    "run_calibration",
]


@dataclass(frozen=True, slots=True)
class Microbench:
    shared_prefix_tokens: int
    decode_new_tokens: int
    decode_output_tokens: int
    full_prefill_tokens: int
    append_marker_tokens: int
    append_new_tokens: int
    prefill_output_tokens: int
    admission_delay_s: float
    profile_overrides: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    target: float
    model: float
    unit: str
    low: float
    high: float

    @property
    def ok(self) -> bool:
        return self.low <= self.model <= self.high


def load_targets() -> dict[str, Any]:
    text = resources.files("simulator.tools.calibration").joinpath("targets.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def _load_data(name: str) -> dict[str, Any]:
    text = resources.files("simulator.tools.calibration").joinpath(name).read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def mean_decode_tpot(
    profile: Profile, bench: Microbench, *, batch: int, prefills: int, kind: str, context: int | None = None
) -> float:
    """Mean decode TPOT (seconds) of one micro-benchmark run; ``kind`` is full, append or none."""
    prefix_tokens = context if context is not None else bench.shared_prefix_tokens
    bs = profile.scheduler.block_size
    n_prefix_blocks = prefix_tokens // bs
    shared = StreamBlocks(0)
    engine = Engine(
        profile, EngineConfig(kv_capacity_tokens=max(profile.kv_capacity_tokens, 4 * prefix_tokens))
    )
    warm = EngineRequest(request_id="warm", n_prompt=prefix_tokens, content=shared, max_tokens=1)
    warmed = run_engine(engine, [(0.0, warm)])
    t0 = warmed.end + 1.0
    arrivals: list[tuple[float, EngineRequest]] = []
    delta = bench.admission_delay_s
    for i in range(batch):
        content = PrefixedBlocks(shared, n_prefix_blocks, StreamBlocks(1000 + i))
        r = EngineRequest(
            request_id=f"d{i}",
            n_prompt=prefix_tokens + bench.decode_new_tokens,
            content=content,
            max_tokens=bench.decode_output_tokens,
            ignore_eos=True,
        )
        arrivals.append((t0 + delta * len(arrivals), r))
    for j in range(prefills if kind != "none" else 0):
        if kind == "full":
            r = EngineRequest(
                request_id=f"p{j}",
                n_prompt=bench.full_prefill_tokens,
                content=StreamBlocks(100_000 + j),
                max_tokens=bench.prefill_output_tokens,
                ignore_eos=True,
            )
        else:
            r = EngineRequest(
                request_id=f"p{j}",
                n_prompt=prefix_tokens + bench.append_marker_tokens + bench.append_new_tokens,
                content=PrefixedBlocks(shared, n_prefix_blocks, StreamBlocks(100_000 + j)),
                max_tokens=bench.prefill_output_tokens,
                ignore_eos=True,
            )
        arrivals.append((t0 + delta * len(arrivals), r))
    run = run_engine(engine, arrivals)
    tpots = []
    for i in range(batch):
        times = run.requests[f"d{i}"]
        assert times.first_token is not None
        assert times.finished is not None
        tpots.append((times.finished - times.first_token) / (bench.decode_output_tokens - 1))
    return sum(tpots) / len(tpots)


def _bench(raw: dict[str, Any]) -> Microbench:
    return Microbench(**raw)


def interference_figures(profile: Profile, targets: dict[str, Any] | None = None) -> list[Figure]:
    """The six interference figures of docs/emulator-model.md 3.3, target vs model."""
    targets = targets or load_targets()
    bench = _bench(targets["microbench"])
    prof = profile.with_overrides(bench.profile_overrides)
    rel = targets["relative_tolerance"]
    small = targets["small_target_abs_tolerance"]
    baselines: dict[tuple[int, int], float] = {}
    out = []
    for spec in targets["interference"]:
        key = (spec["batch"], spec["context"])
        if key not in baselines:
            baselines[key] = mean_decode_tpot(
                prof, bench, batch=spec["batch"], prefills=0, kind="none", context=spec["context"]
            )
        tpot = mean_decode_tpot(
            prof,
            bench,
            batch=spec["batch"],
            prefills=spec["prefills"],
            kind=spec["kind"],
            context=spec["context"],
        )
        ratio = tpot / baselines[key]
        target = float(spec["target"])
        if spec["unit"] == "x":
            model = ratio
            low = float(spec.get("low", target * (1 - rel)))
            high = float(spec.get("high", target * (1 + rel)))
            low, high = min(low, target * (1 - rel)), max(high, target * (1 + rel))
        else:
            model = (ratio - 1.0) * 100.0
            tol = max(rel * target, small if spec["kind"] == "append" else 0.0)
            low, high = target - tol, target + tol
            if spec.get("upper_bound"):
                low, high = -small, target
        out.append(Figure(spec["name"], target, model, spec["unit"], low, high))
    return out


def kv_transfer_figures(profile: Profile, targets: dict[str, Any] | None = None) -> list[Figure]:
    """Time to move a 5,115-token context over each link preset, alone (docs/emulator-model.md 3.4)."""
    targets = targets or load_targets()
    spec = targets["kv_transfer"]
    rel = targets["relative_tolerance"]
    n_bytes = spec["context_tokens"] * profile.model.kv_bytes_per_token
    out = []
    for link_spec in profile.links:
        link = Link(link_spec, TransferMode.SHARED_LINK)
        link.start(0.0, n_bytes)
        done_at = link.next_completion_at()
        assert done_at is not None
        model = done_at * 1e3
        target = spec["targets_ms"].get(link_spec.name)
        name = f"KV {spec['context_tokens']} tok ({n_bytes / 1e6:.1f} MB) over {link_spec.name}"
        if target is None:
            out.append(Figure(name + " (prediction)", float("nan"), model, "ms", 0.0, float("inf")))
        else:
            out.append(Figure(name, target, model, "ms", target * (1 - rel), target * (1 + rel)))
    return out


def raw_figures(
    profile: Profile, targets: dict[str, Any] | None = None, batch_sizes: list[int] | None = None
) -> list[Figure]:
    """Absolute mean decode TPOT vs the January-2026 raw data, per scenario and batch size."""
    targets = targets or load_targets()
    spec = targets["raw_jan2026"]
    data = _load_data(spec["data"])["core"]["decode_tpot_ms"]
    bench = _bench(spec["microbench"])
    prof = profile.with_overrides(bench.profile_overrides)
    rel = targets["relative_tolerance"]
    out = []
    for batch in batch_sizes or spec["batch_sizes"]:
        for scenario, (n, kind) in spec["scenarios"].items():
            measured = data[scenario].get(str(batch))
            if measured is None:
                continue
            model = mean_decode_tpot(prof, bench, batch=batch, prefills=n, kind=kind) * 1e3
            name = f"Jan-2026 {scenario}, B={batch}: decode TPOT"
            out.append(Figure(name, measured, model, "ms", measured * (1 - rel), measured * (1 + rel)))
    return out


def _format(fig: Figure) -> str:
    status = "ok " if fig.ok else "OFF"
    target = "   -   " if fig.target != fig.target else f"{fig.target:7.1f}"
    return f"  {status} {fig.name:<58} target {target}{fig.unit:<2}  model {fig.model:7.2f}{fig.unit}"


def run_calibration(profile_name: str, *, as_json: bool, raw: bool, out: TextIO) -> int:
    """Print every figure; exit status 1 when one is outside its tolerance."""
    profile = load_profile(profile_name)
    groups = {
        "interference (docs/emulator-model.md 3.1/3.3)": interference_figures(profile),
        "KV transfer (3.4)": kv_transfer_figures(profile),
    }
    if raw:
        groups["raw data, January-2026 run, by batch size"] = raw_figures(profile)
    bad = sum(1 for figs in groups.values() for f in figs if not f.ok)
    if as_json:
        payload = {
            "profile": profile.name,
            "groups": {k: [{**asdict(f), "ok": f.ok} for f in v] for k, v in groups.items()},
            "failures": bad,
        }
        out.write(json.dumps(payload, default=str) + "\n")
    else:
        out.write(f"profile {profile.name}\n")
        for title, figs in groups.items():
            out.write(f"{title}\n")
            for fig in figs:
                out.write(_format(fig) + "\n")
        out.write("all figures within tolerance\n" if not bad else f"{bad} figure(s) outside tolerance\n")
    return 0 if not bad else 1

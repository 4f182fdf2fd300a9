"""``ppd-bench admission``: overload with and without admission control, on the virtual-time cluster.

Seeded multi-turn ShareGPT conversations (``loadgen.sharegpt``) on a simulated cluster in mode ``pd``,
through the gateway's own admission policy (``ppd.admission``, which the cluster runs in virtual time:
``simulator.core.cluster``'s ``ClusterConfig.admission``).

1. Capacity: one run per level of ``capacity_levels`` (conversations started per second, each for
   ``step_s`` seconds); the pd capacity is the highest level at which at least ``capacity_share`` of
   the requests meet the TTFT SLO (``ttft_slo_ms``), and its goodput (requests meeting the SLO per
   second of arrivals) is the capacity goodput. The in-flight bound of the admission arm comes from the
   same run (Little's law: the mean number of requests in flight at capacity, per decode worker),
   unless ``max_inflight_per_worker`` is given; every class may wait ``ttft_slo_ms / 2`` at most (so
   an admitted request keeps half the SLO for its prefill), and as many may wait as may be in flight.
2. The ramp: ``step_s`` seconds at each of ``ramp`` x capacity, two tenants side by side (a tenant is a
   conversation's workload name): ``high`` (priority high) with ``high_share`` of the conversations,
   ``low`` (priority low) with the rest; the same arrivals for both arms: ``no admission`` and
   ``admission``. A shed request ends its conversation (a client that gives up, not one that retries).
3. Idle: the high tenant's conversations of the ramp's last step alone, no admission: its TTFT P99 when
   nothing competes.
Figures per ramp step and arm (by arrival time): goodput, TTFT P99 of the requests served (admitted),
the share shed; goals as the issue states them. Time to answer a shed request is 0 in virtual time
(the policy answers at once); the live gateway's is measured by ``benchmarks/admission_shed.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from loadgen.arguments import positive, positive_list
from loadgen.report.section import (
    add_experiment_parser,
    md_table,
    ms,
    p99,
    print_section,
    progress_printer,
    save_png,
)
from ppd.admission import AdmissionSettings, TenantSettings

__all__ = [
    "AdmissionExperiment",
    "AdmissionFigures",
    "Step",
    "add_parser",
    "admission_settings",
    "run_admission",
]

SECTION_NAME: Final = "admission.md"
PNG_NAME: Final = "admission.png"
HIGH: Final = "high"
LOW: Final = "low"
ARMS: Final = ("no admission", "admission")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionExperiment:
    shape: str = "1P3D"
    model: str = "llama-3.1-8b"
    profile: str = "llama-3.1-8b-h100"
    seed: int = 0
    #: ShareGPT conversations drawn (their turn sizes cycle over the arrivals).
    conversations: int = 300
    ttft_slo_ms: float = 1000.0
    #: Conversations started per second of the capacity search, one run each.
    capacity_levels: tuple[float, ...] = (8.0, 12.0, 16.0, 20.0, 24.0, 28.0, 32.0)
    #: The share of requests meeting the SLO at which a level still counts as within capacity.
    capacity_share: float = 0.95
    #: The ramp's steps as multiples of the capacity.
    ramp: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    step_s: float = 60.0
    high_share: float = 0.1
    #: The admission arm's bound per decode worker (None: from the capacity run, by Little's law).
    max_inflight_per_worker: int | None = None
    timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Step:
    arm: str
    load: float  # multiple of the capacity
    qps: float  # conversations started per second
    requests: int
    goodput: float  # requests meeting the TTFT SLO per second of the step
    ttft_p99_ms: float | None  # of the requests served
    high_ttft_p99_ms: float | None  # the high tenant's, served
    shed_share: float


@dataclass(frozen=True, slots=True)
class AdmissionFigures:
    capacity_qps: float
    capacity_goodput: float
    inflight_per_worker: int
    idle_high_ttft_p99_ms: float | None
    steps: tuple[Step, ...]

    def step(self, arm: str, load: float) -> Step | None:
        return next((s for s in self.steps if s.arm == arm and s.load == load), None)


def _lists(settings: AdmissionExperiment) -> list[tuple[tuple[int, int], ...]]:
    from loadgen.sharegpt import sharegpt_pool
    from loadgen.tokens import llama3_counter

    pool = sharegpt_pool(llama3_counter(), seed=settings.seed, count=settings.conversations)
    return [
        tuple((t.n_in, t.n_out) for t in pool.conversation(i).turns) for i in range(len(pool.conversations))
    ]


def _conversations(
    lists: Sequence[Sequence[tuple[int, int]]], tenant: str, qps: float, settings: AdmissionExperiment, k: int
) -> list[Any]:
    """``step_s`` seconds of one tenant's conversations at ``qps`` from step ``k``'s start."""
    from simulator.core.workload import Conversation, turn_list_conversations

    seed = settings.seed * 1000 + k * 2 + (tenant == HIGH)
    convs = turn_list_conversations(lists, qps, settings.step_s, workload=tenant, seed=seed)
    offset = k * settings.step_s
    return [Conversation(f"{c.conversation_id}-{k}", tenant, c.start + offset, c.turns) for c in convs]


def _simulate(
    settings: AdmissionExperiment,
    conversations: Sequence[Any],
    admission: AdmissionSettings | None,
    run_id: str,
) -> list[dict[str, Any]]:
    from simulator.core.cluster import ClusterConfig, simulate
    from simulator.core.profile import load_profile
    from simulator.core.topology import Topology

    config = ClusterConfig(
        topology=Topology.parse(settings.shape),
        mode="pd",
        timeout_s=settings.timeout_s,
        run_id=run_id,
        model=settings.model,
        admission=admission,
    )
    return simulate(load_profile(settings.profile), config, conversations).records


def _good(r: Mapping[str, Any], slo_ms: float) -> bool:
    return bool(r["ok"]) and r["ttft_ms"] is not None and float(r["ttft_ms"]) <= slo_ms


def _capacity(
    settings: AdmissionExperiment, lists: Sequence[Sequence[tuple[int, int]]], say: Callable[[str], None]
) -> tuple[float, float, float]:
    """Rule 1: the capacity (conversations/s), its goodput and the mean requests in flight there."""
    found = (0.0, 0.0, 0.0)
    for k, qps in enumerate(settings.capacity_levels):
        records = _simulate(settings, _conversations(lists, LOW, qps, settings, k), None, f"capacity-{qps:g}")
        good = sum(1 for r in records if _good(r, settings.ttft_slo_ms))
        say(f"capacity search: {qps:g} conversations/s, {good} of {len(records)} requests within the SLO")
        if not records or good < settings.capacity_share * len(records):
            break
        busy = math.fsum(float(r["e2e_ms"]) / 1e3 for r in records if r["ok"])
        found = (qps, good / settings.step_s, busy / settings.step_s)
    if not found[0]:
        raise ValueError("the lowest capacity level already misses the SLO: lower --capacity-levels")
    return found


def admission_settings(settings: AdmissionExperiment, per_worker: int) -> AdmissionSettings:
    """The admission arm's settings (rule 1), with the two tenants' classes (rule 2)."""
    decode = _decode_workers(settings.shape)
    wait = settings.ttft_slo_ms / 2e3
    return AdmissionSettings(
        enabled=True,
        max_inflight_per_worker=per_worker,
        max_queue=per_worker * decode,
        max_wait_high_s=wait,
        max_wait_normal_s=wait,
        max_wait_low_s=wait,
        tenants={HIGH: TenantSettings(priority="high"), LOW: TenantSettings(priority="low")},
    )


def _decode_workers(shape: str) -> int:
    from simulator.core.topology import Topology

    t = Topology.parse(shape)
    return t.decode or t.replica


def _steps(
    arm: str, records: Sequence[Mapping[str, Any]], settings: AdmissionExperiment, capacity: float
) -> list[Step]:
    out = []
    for k, load in enumerate(settings.ramp):
        lo, hi = k * settings.step_s, (k + 1) * settings.step_s
        rows = [r for r in records if lo <= r["start_time"] < hi]
        served = [r for r in rows if r["ok"] and r["ttft_ms"] is not None]
        high = [float(r["ttft_ms"]) for r in served if r["workload"] == HIGH]
        shed = sum(1 for r in rows if str(r["error"] or "").startswith("shed_"))
        out.append(
            Step(
                arm=arm,
                load=load,
                qps=load * capacity,
                requests=len(rows),
                goodput=sum(1 for r in rows if _good(r, settings.ttft_slo_ms)) / settings.step_s,
                ttft_p99_ms=p99([float(r["ttft_ms"]) for r in served]),
                high_ttft_p99_ms=p99(high),
                shed_share=shed / len(rows) if rows else 0.0,
            )
        )
    return out


def _goals(fig: AdmissionFigures, settings: AdmissionExperiment) -> list[list[str]]:
    peak = max(settings.ramp)
    on, off = fig.step("admission", peak), fig.step("no admission", peak)
    marks = {True: "PASS", False: "FAIL", None: "n/a"}
    rows = []
    if on is not None and off is not None:
        share = on.goodput / fig.capacity_goodput if fig.capacity_goodput else None
        rows.append(
            [
                f"goodput at {peak:g}x capacity >= 90% of capacity's, with admission",
                marks[None if share is None else share >= 0.9],
                f"{on.goodput:.1f} req/s = {100 * (share or 0):.0f}% of {fig.capacity_goodput:.1f} "
                f"(without admission: {off.goodput:.1f} req/s)",
            ]
        )
        rows.append(
            [
                f"TTFT P99 of admitted requests within the SLO ({settings.ttft_slo_ms:g} ms)",
                marks[None if on.ttft_p99_ms is None else on.ttft_p99_ms <= settings.ttft_slo_ms],
                f"{ms(on.ttft_p99_ms)} ms (without admission: {ms(off.ttft_p99_ms)} ms)",
            ]
        )
        idle, busy = fig.idle_high_ttft_p99_ms, on.high_ttft_p99_ms
        within = None if idle is None or busy is None else busy <= 1.2 * idle
        rows.append(
            [
                f"high-priority tenant's TTFT P99 at {peak:g}x within 20% of idle",
                marks[within],
                f"{ms(busy)} vs {ms(idle)} ms idle (without admission: {ms(off.high_ttft_p99_ms)} ms)",
            ]
        )
    rows.append(
        [
            "a shed request answered within 10 ms",
            "n/a",
            "0 in virtual time; the live gateway's: benchmarks/admission_shed.py",
        ]
    )
    return rows


def _drawing(fig: AdmissionFigures, settings: AdmissionExperiment) -> Callable[[Any], None]:
    def draw(axes: Any) -> None:
        for arm in ARMS:
            steps = [s for s in fig.steps if s.arm == arm]
            axes[0].plot([s.load for s in steps], [s.goodput for s in steps], marker="o", label=arm)
            pts = [(s.load, s.ttft_p99_ms) for s in steps if s.ttft_p99_ms is not None]
            if pts:
                axes[1].plot(*zip(*pts, strict=True), marker="o", label=arm)
        axes[0].axhline(fig.capacity_goodput, color="gray", linestyle=":", label="capacity goodput")
        axes[0].set_ylabel(f"goodput: requests/s with TTFT <= {settings.ttft_slo_ms:g} ms")
        axes[1].axhline(settings.ttft_slo_ms, color="black", linestyle=":", label="SLO")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("TTFT P99 of requests served (ms)")
        for ax in axes:
            ax.set_xlabel("offered load (x pd capacity)")
            ax.legend(fontsize=7)

    return draw


def run_admission(
    settings: AdmissionExperiment, out: Path, *, progress: Callable[[str], None] | None = None
) -> tuple[AdmissionFigures, Path]:
    """Rules 1-3 into ``out``: ``admission.md``, ``admission.png`` and ``admission.json``."""
    say = progress or (lambda _line: None)
    lists = _lists(settings)
    capacity, capacity_goodput, inflight = _capacity(settings, lists, say)
    per_worker = settings.max_inflight_per_worker or max(
        1, math.ceil(inflight / _decode_workers(settings.shape))
    )
    conversations: list[Any] = []
    for k, load in enumerate(settings.ramp):
        qps = load * capacity
        conversations += _conversations(lists, HIGH, qps * settings.high_share, settings, k)
        conversations += _conversations(lists, LOW, qps * (1 - settings.high_share), settings, k)
    conversations.sort(key=lambda c: c.start)
    steps: list[Step] = []
    for arm in ARMS:
        say(f"ramp, {arm}: {len(conversations)} conversations on {settings.shape} ...")
        adm = admission_settings(settings, per_worker) if arm == "admission" else None
        records = _simulate(settings, conversations, adm, "admission-" + arm.replace(" ", "-"))
        steps += _steps(arm, records, settings, capacity)
    last = len(settings.ramp) - 1
    alone = [c for c in conversations if c.workload == HIGH and c.start >= last * settings.step_s]
    idle_records = _simulate(settings, alone, None, "admission-idle")
    idle = p99([float(r["ttft_ms"]) for r in idle_records if r["ok"] and r["ttft_ms"] is not None])
    fig = AdmissionFigures(capacity, capacity_goodput, per_worker, idle, tuple(steps))
    caption = (
        f"virtual-time cluster {settings.shape}, {settings.profile}, mode pd, ShareGPT multi-turn "
        f"({settings.conversations} conversations, seed {settings.seed}); "
        f"TTFT SLO {settings.ttft_slo_ms:g} ms; "
        f"capacity {capacity:g} conversations/s; ramp {','.join(f'{x:g}' for x in settings.ramp)}x, "
        f"{settings.step_s:g} s each; high tenant {100 * settings.high_share:g}% of conversations"
    )
    adm = admission_settings(settings, per_worker)
    lines = ["## Overload and admission control", "", f"What was run: {caption}.", ""]
    lines += [
        f"- admission arm: max_inflight_per_worker = {per_worker} (Little's law at capacity), "
        f"max_queue = {adm.max_queue}, every class waits {adm.max_wait_low_s:g} s at most; tenant "
        f"`{HIGH}` priority high, `{LOW}` priority low; a shed request ends its conversation",
        "",
    ]
    lines += md_table(["goal", "result", "measured"], _goals(fig, settings))
    rows = [
        [
            s.arm,
            f"{s.load:g}x ({s.qps:.1f}/s)",
            str(s.requests),
            f"{s.goodput:.1f}",
            ms(s.ttft_p99_ms),
            ms(s.high_ttft_p99_ms),
            f"{100 * s.shed_share:.0f}%",
        ]
        for s in steps
    ]
    lines += md_table(
        [
            "arm",
            "load (conversations/s)",
            "requests",
            "goodput (req/s)",
            "TTFT P99 (ms)",
            "high tenant P99 (ms)",
            "shed",
        ],
        rows,
    )
    out.mkdir(parents=True, exist_ok=True)
    save_png(
        out / PNG_NAME,
        "Overload with and without admission control",
        caption,
        _drawing(fig, settings),
        panels=2,
    )
    lines += [f"![admission]({PNG_NAME})", ""]
    path = out / SECTION_NAME
    path.write_text("\n".join(lines), encoding="utf-8")
    (out / "admission.json").write_text(
        json.dumps(dataclasses.asdict(fig), indent=2) + "\n", encoding="utf-8"
    )
    return fig, path


# ---------------------------------------------------------------------------------------- the command


def _command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    del environ
    settings = AdmissionExperiment(
        shape=args.shape,
        seed=args.seed,
        conversations=args.conversations,
        ttft_slo_ms=args.ttft_slo_ms,
        capacity_levels=args.capacity_levels,
        ramp=args.ramp,
        step_s=args.step,
        high_share=args.high_share,
        max_inflight_per_worker=args.max_inflight_per_worker,
    )
    fig, path = run_admission(settings, args.out, progress=progress_printer(args.no_progress))
    print_section("admission", path, _goals(fig, settings))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``admission`` subcommand of ``ppd-bench``."""
    d = AdmissionExperiment()
    parser = add_experiment_parser(
        sub,
        "admission",
        help="overload with and without admission control, on the virtual-time simulator",
        description="Finds the pd capacity of a simulated cluster on ShareGPT multi-turn traffic, then "
        "ramps the arrivals to a multiple of it with a high-priority tenant beside a low-priority one, "
        "with and without the gateway's admission control. Writes admission.md (a report section), "
        "admission.png and admission.json into --out.",
        shape=d.shape,
        seed=d.seed,
    )
    parser.add_argument(
        "--conversations", type=int, default=d.conversations,
        help=f"ShareGPT conversations drawn (default {d.conversations})",
    )  # fmt: skip
    parser.add_argument(
        "--ttft-slo-ms",
        type=positive,
        default=d.ttft_slo_ms,
        help=f"the TTFT SLO (default {d.ttft_slo_ms:g})",
    )
    parser.add_argument(
        "--capacity-levels", type=positive_list, default=d.capacity_levels,
        help="conversations/s tried for the capacity "
        f"(default {','.join(f'{q:g}' for q in d.capacity_levels)})",
    )  # fmt: skip
    parser.add_argument(
        "--ramp", type=positive_list, default=d.ramp,
        help=f"the ramp's steps, x capacity (default {','.join(f'{q:g}' for q in d.ramp)})",
    )  # fmt: skip
    parser.add_argument(
        "--step", type=positive, default=d.step_s, help=f"seconds per step (default {d.step_s:g})"
    )
    parser.add_argument(
        "--high-share", type=positive, default=d.high_share,
        help=f"the high-priority tenant's share of conversations (default {d.high_share:g})",
    )  # fmt: skip
    parser.add_argument(
        "--max-inflight-per-worker", type=int, default=None,
        help="the admission arm's in-flight bound per decode worker (default: Little's law at capacity)",
    )  # fmt: skip
    parser.set_defaults(handler=_command)

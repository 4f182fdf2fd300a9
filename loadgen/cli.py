"""``ppd-bench``: run a multi-turn load against an OpenAI-compatible URL, or write the report.

    ppd-bench run --url http://127.0.0.1:8000 --workload large_mid_paste --qps 4 --duration 10 --out r.jsonl
    ppd-bench report --records DIR --out DIR
    ppd-bench drift --out DIR        (stale table vs closed loop vs oracle across a drift, simulated)
    ppd-bench slo --out DIR          (fixed weights vs the SLO controller on a load ramp, simulated)
    ppd-bench admission --out DIR    (overload with and without admission control, simulated)
    ppd-bench plan --gpus 4 --out DIR (which P:D split and mode for N GPUs, simulated)

Only this module reads argv and the environment (``OPENAI_API_KEY``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from loadgen.arguments import positive
from loadgen.load import LoadError, LoadSettings, run_load
from loadgen.report.comparison import ManifestError
from loadgen.sharegpt import SHAREGPT_WORKLOAD, SharegptLimits, sharegpt_pool
from loadgen.summary import format_summary, summarize
from loadgen.tokens import llama3_counter
from loadgen.workloads import (
    MAX_TURNS,
    SYNTHETIC_WORKLOADS,
    SharedPrefixWorkload,
    SyntheticWorkload,
    Workload,
    WorkloadError,
    single_token_words,
)
from ppd.catalog import is_shared_prefix
from ppd.modes import ModeError, parse_mode
from table_builder.records import RecordsError, RecordWriter

__all__ = ["build_parser", "main"]

logger = logging.getLogger("ppd-bench")


def _mode(text: str) -> str:
    try:
        parse_mode(text)
    except ModeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="send multi-turn conversations at a target QPS and write benchmark records",
        description="Poisson arrivals of multi-turn conversations for a fixed duration against any "
        "OpenAI-compatible URL; one JSONL benchmark record per request; a summary at the end.",
    )
    run.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    run.add_argument(
        "--workload",
        required=True,
        help=f"'{SHAREGPT_WORKLOAD}' or a synthetic <turn1>_<class> name: {', '.join(SYNTHETIC_WORKLOADS)} "
        "(and the huge_<class> extension, Turn 1 = 4096/1024), or a shared-prefix workload "
        "shared<L>_<G>x<C>_<turn1>_<class>: G groups of C conversations, each group's opening with the "
        "same L-token system prompt (16..8192), e.g. shared2048_4x8_small_mid_bal",
    )
    run.add_argument("--qps", type=positive, required=True, help="conversation arrival rate (per second)")
    run.add_argument("--duration", type=positive, required=True, help="seconds of arrivals")
    run.add_argument("--out", type=Path, required=True, help="JSONL records file (overwritten)")
    run.add_argument("--seed", type=int, default=0, help="seed for arrivals and conversations (default 0)")
    run.add_argument(
        "--turns",
        type=int,
        default=None,
        help=f"turns per conversation, 1..{MAX_TURNS} (default: 2 synthetic and shared-prefix, all recorded "
        "for ShareGPT)",
    )
    run.add_argument(
        "--mode",
        type=_mode,
        default="ppd",
        help="mode label of the records: pd, local, ppd, replica, fraction:<x> (default ppd)",
    )
    run.add_argument(
        "--send-mode",
        action="store_true",
        help="also ask our gateway for --mode per request (X-PPD-Mode; honoured where the gateway sets "
        "allow_mode_header = true, as ppd-up does)",
    )
    run.add_argument("--shape", default="1P3D", help="deployment shape label for the records (default 1P3D)")
    run.add_argument("--model-label", default="llama-3.1-8b", help="model label for the records")
    run.add_argument("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    run.add_argument("--timeout", type=positive, default=30.0, help="per-request timeout, s (default 30)")
    run.add_argument("--run-id", default=None, help="run id in the records (default from the settings)")
    run.add_argument("--no-session-header", action="store_true", help="do not send X-Session-ID")
    run.add_argument("--max-output-tokens", type=int, default=1024, help="ShareGPT answer cap (default 1024)")
    run.add_argument(
        "--max-context-tokens", type=int, default=8192, help="ShareGPT conversation budget (default 8192)"
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.set_defaults(handler=_run)


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadgen.report import admission, bidir, command, drift, sim_vs_real, slo

    command.add_parser(sub)
    bidir.add_parser(sub)
    drift.add_parser(sub)
    slo.add_parser(sub)
    admission.add_parser(sub)
    sim_vs_real.add_parser(sub)


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from loadgen.plan import command as plan

    plan.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-bench", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_report(sub)
    _add_plan(sub)
    return parser


def _workload(args: argparse.Namespace, qps: float, duration: float) -> Workload:
    counter = llama3_counter()
    if args.workload == SHAREGPT_WORKLOAD:
        count = max(16, math.ceil(qps * duration * 1.5) + 8)
        limits = SharegptLimits(
            max_output_tokens=args.max_output_tokens, max_context_tokens=args.max_context_tokens
        )
        return sharegpt_pool(counter, seed=args.seed, count=count, limits=limits, turns=args.turns)
    if is_shared_prefix(args.workload):
        return SharedPrefixWorkload(
            name=args.workload, words=single_token_words(counter), seed=args.seed, turns=args.turns or 2
        )
    return SyntheticWorkload(
        name=args.workload, words=single_token_words(counter), seed=args.seed, turns=args.turns or 2
    )


def _run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    workload = _workload(args, args.qps, args.duration)
    run_id = args.run_id or f"{args.workload}-{args.mode}-q{args.qps:g}-s{args.seed}"
    settings = LoadSettings(
        url=args.url,
        qps=args.qps,
        duration_s=args.duration,
        run_id=run_id,
        workload=args.workload,
        seed=args.seed,
        timeout_s=args.timeout,
        served_model=args.model,
        shape=args.shape,
        model_label=args.model_label,
        mode=args.mode,
        send_mode_header=args.send_mode,
        send_session_header=not args.no_session_header,
        api_key=environ.get("OPENAI_API_KEY"),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with RecordWriter(args.out, append=False) as writer:
        result = asyncio.run(
            run_load(settings, workload, on_record=writer.write, progress=not args.no_progress)
        )
    print(
        f"run {run_id}: {result.conversations} conversations (ids tagged -r{settings.run_tag}), "
        f"records in {args.out}"
    )
    print(format_summary(summarize(result.records)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        code: int = args.handler(args, os.environ)
    except (LoadError, WorkloadError, RecordsError, ManifestError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted")
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())

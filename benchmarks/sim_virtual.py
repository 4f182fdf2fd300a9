"""Benchmark of the virtual-time cluster simulation: simulated requests per CPU-second, and the trends.

``ppd-sim bench-virtual`` (or ``python -m benchmarks.sim_virtual``) runs two-turn conversations
(the first two turns of real ShareGPT conversations by default, as the issue's target says; or
``sharegpt-like`` lengths drawn without the dataset; or one of the 18 synthetic workloads, or a
shared-prefix one, ``shared<L>_<G>x<C>_<turn1>_<class>``) through a simulated cluster in each
requested mode and prints, per mode, the CPU time, the throughput, the discrete events per request
(what the speed mostly depends on), the Turn-2 figures (mean TTFT, mean TPOT, success rate) and the
share of prompt tokens all engines found in their prefix caches. The speed target is 20,000 requests
per CPU-second on 1P3D; ``core=`` says whether the run used the compiled core (``ppd-sim
build-native``, :mod:`simulator.tools.native_build`) or the interpreted one.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from ppd.catalog import is_shared_prefix
from simulator.core.cluster import ClusterConfig, simulate
from simulator.core.link import TransferMode
from simulator.core.profile import load_profile
from simulator.core.routing import TableRouter
from simulator.core.topology import Topology
from simulator.core.workload import (
    Conversation,
    shared_prefix_conversations,
    sharegpt_like,
    synthetic_conversations,
    turn_list_conversations,
)
from simulator.tools.native_build import native_state

__all__ = ["add_arguments", "main", "run_bench", "run_from_args", "summarise"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="llama-3.1-8b-h100", help="profile name or JSON path")
    parser.add_argument("--shape", default="1P3D", help="cluster topology, e.g. 1P3D, 2P2D, 4R")
    parser.add_argument(
        "--modes", default="pd,local", help="comma-separated modes (pd, local, fraction:x, replica)"
    )
    parser.add_argument(
        "--workload",
        default="sharegpt",
        help="sharegpt (real conversations, first two turns), sharegpt-like, a synthetic name, or a "
        "shared-prefix one (shared<L>_<G>x<C>_<turn1>_<class>, e.g. shared2048_8x16_small_mid_bal)",
    )
    parser.add_argument("--qps", type=float, default=8.0, help="conversations per second")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    parser.add_argument("--link", default="nvlink", help="link preset (nvlink, ib_ndr, ib_hdr, 100gbe)")
    parser.add_argument(
        "--transfer-mode",
        default="shared_link",
        choices=[m.value for m in TransferMode],
        help="KV transfer model",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode; the fastest counts")
    parser.add_argument("--seed", type=int, default=1, help="workload seed")
    parser.add_argument("--table", default=None, help="table file for mode ppd (decision_service format)")
    parser.add_argument("--json", action="store_true", help="one JSON line per mode")


def _sharegpt_two_turns(count: int, seed: int) -> list[list[tuple[int, int]]]:
    """The first two turns of ``count`` seeded ShareGPT conversations, sized with the Llama-3 tokenizer.

    The dataset reader lives in the table builder (the load generator's workload); imported here only
    for this workload, so the simulator itself does not need the dataset.
    """
    from loadgen.sharegpt import sharegpt_pool
    from loadgen.tokens import llama3_counter

    pool = sharegpt_pool(llama3_counter(), seed=seed, count=count)
    return [
        [(t.n_in, t.n_out) for t in pool.conversation(i).turns[:2]] for i in range(len(pool.conversations))
    ]


def _conversations(workload: str, qps: float, duration: float, seed: int) -> list[Conversation]:
    n = max(16, int(qps * duration) + 1)  # enough distinct conversations for the Poisson arrivals
    if workload == "sharegpt":
        return turn_list_conversations(_sharegpt_two_turns(n, seed), qps, duration, seed=seed)
    if workload == "sharegpt-like":
        return turn_list_conversations(sharegpt_like(n, seed=seed), qps, duration, seed=seed)
    if is_shared_prefix(workload):
        return shared_prefix_conversations(workload, qps, duration, seed=seed)
    return synthetic_conversations(workload, qps, duration, seed=seed)


def summarise(records: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """Turn-2+ means and the success rate, the figures the table builder compares."""
    later = [r for r in records if r["turn"] >= 2]
    ok = [r for r in later if r["ok"]]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    return {
        "requests": len(records),
        "success_rate": sum(1 for r in records if r["ok"]) / len(records) if records else None,
        "turn2_ttft_ms": sum(ttft) / len(ttft) if ttft else None,
        "turn2_tpot_ms": sum(tpot) / len(tpot) if tpot else None,
    }


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = load_profile(args.profile)
    convs = _conversations(args.workload, args.qps, args.duration, args.seed)
    out = []
    core = native_state()
    for mode in args.modes.split(","):
        config = ClusterConfig(
            topology=Topology.parse(args.shape),
            mode=mode,
            link=args.link,
            transfer_mode=TransferMode(args.transfer_mode),
            target_qps=args.qps,
        )
        best = float("inf")
        records: list[dict[str, Any]] = []
        events = steps = queries = hits = 0
        for _ in range(max(1, args.repeat)):
            router = TableRouter.open(args.table) if mode == "ppd" and args.table else None
            t0 = time.process_time()
            result = simulate(profile, config, convs, router)
            best = min(best, time.process_time() - t0)
            records, events, steps = result.records, result.events, result.engine_steps
            queries = sum(s.prefix_cache_queries for s in result.engine_stats.values())
            hits = sum(s.prefix_cache_hits for s in result.engine_stats.values())
        row: dict[str, Any] = {
            "shape": args.shape,
            "mode": mode,
            "workload": args.workload,
            "qps": args.qps,
            "link": args.link,
            "transfer_mode": args.transfer_mode,
            "core": core,
            "cpu_s": best,
            "requests_per_cpu_s": len(records) / best if best > 0 else None,
            "events": events,
            "engine_steps": steps,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            **summarise(records),
        }
        out.append(row)
    return out


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_from_args(args: argparse.Namespace) -> int:
    try:
        rows = run_bench(args)
    except (ValueError, ImportError) as exc:  # an unknown workload, or no ShareGPT data installed
        log.error("bench-virtual: %s (--workload sharegpt-like needs no dataset)", exc)
        return 2
    for row in rows:
        if args.json:
            sys.stdout.write(json.dumps(row) + "\n")
        else:
            sys.stdout.write(
                f"{row['shape']} {row['mode']:<12} {row['workload']} qps={row['qps']:g} link={row['link']} "
                f"core={row['core']}: "
                f"{row['requests']} requests in {row['cpu_s']:.3f} CPU-s = "
                f"{_fmt(row['requests_per_cpu_s'], ',.0f')} req/CPU-s "
                f"({row['events'] / max(1, row['requests']):.1f} events/request) | turn2 TTFT "
                f"{_fmt(row['turn2_ttft_ms'], '.1f')} ms, TPOT {_fmt(row['turn2_tpot_ms'], '.2f')} ms, "
                f"success {_fmt(row['success_rate'], '.3f')}, "
                f"prefix cache hits {_fmt(row['prefix_cache_hit_rate'], '.1%')}\n"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_virtual", description=__doc__)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

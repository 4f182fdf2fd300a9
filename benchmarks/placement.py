"""What prefix-aware placement costs the gateway per request: prints figures, asserts nothing.

    python -m benchmarks.placement [--rounds 5] [--conversations 48] [--turns 4] [--streams 8]
                                   [--history-tokens 512] [--max-tokens 16] [--mode pd|ppd]

Two gateways identical but for `[routing] placement` run side by side, alternating, each round a fresh
process per arm: `least_loaded` (placement off: the least-loaded worker, as before placement) and
`prefix`. Both follow the same workers' KV events (`[kv_events]`, so the event stream's own cost is in
both arms) and run --mode: `pd` (the default) sends every turn through a prefill worker (P), so every
Turn 2+ has a P to place and nothing else asks a worker's `/tokenize`; `ppd` asks a DecisionService
(started here on the shipped tables) per Turn 2+, after the D residency check's `/tokenize` (both
arms), whose token ids placement reuses on the turns the table sends through P. They front one
simulated 2P2D cluster (`python -m simulator cluster --topology 2P2D`, real HTTP, KV events published
on real ZMQ sockets), shared by every arm and round.

The same load per arm and round: --conversations multi-turn conversations, each opening with a
unique message of about --history-tokens tokens, then --turns - 1 more turns, each the whole history
(earlier messages and the simulator's answers) plus a short question, every answer streamed
(--max-tokens tokens). Turn 1 of every conversation is sent first (a phase of its own, --streams at a
time), then Turn 2+ (--streams conversations at a time, each one's turns one after another), so the
two are measured apart: with `prefix` a Turn 1 places both its P and its D by resident prefix, a
Turn 2+ only its P (its D is the session's).

Figures, one JSON object per line:
1. `arm` per round, arm and phase (`turn1`, `later`): the gateway's CPU per request from /proc (µs),
   its own time to the first token (`ppd_gateway_overhead_seconds`: the handler's time minus the
   time the workers had the request; the `/tokenize` round trip placement makes is inside it) p50/p99
   in ms, the client's TTFT p50/p99, the share of placed legs the resident prefix chose
   (`ppd_gateway_placements_total`, per role), the legs through P per request, and the `/tokenize`
   calls the gateway made per request (`ppd_gateway_worker_tokenize_total`).
2. `summary`: per arm and phase the medians over the rounds, and `prefix` over `least_loaded` for each.
3. `tokenize`: where placement's added time goes, the parts alone with the cluster idle: a P's
   `/tokenize` round trip for a last turn's prompt from this process (p50/p99 in ms, --tokenize-calls
   calls one after another) and hashing its token ids into block hashes in process (µs, best of 20).
4. `memory`: what placement keeps, in process, per prompt length (1k, 8k and 32k tokens, 16-token
   blocks): a session's marks (`Session.prompt_marks`) as bytes in a shared store's entry and as a
   string in memory, and one remembered opening's marks in memory (`gateway/openings.py`).

One module (about 480 lines): one command, whose four figures share its cluster and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from benchmarks.gateway import MODEL, _emit, _histogram, _pct, _Proc, _quantile, _scrape, _start
from benchmarks.session_store import _turn
from gateway.residency import marks_text, prefix_marks
from gateway.session_codec import session_codec
from gateway.sessions import Session
from ppd.kv_events import BlockHasher

__all__ = ["main"]

ARMS = ("least_loaded", "prefix")
PHASES = ("turn1", "later")
# The workers' PYTHONHASHSEED and the gateway's kv_events.hash_seed: the same block hashes on both sides.
_SEED = "0"
_EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:0",
    "replay_endpoint": "tcp://127.0.0.1:0",
}
_OVERHEAD = "ppd_gateway_overhead_seconds"
_SYNC_DEADLINE_S = 60.0
# The shipped decision tables (mode ppd): the 2P2D one answers this cluster.
_TABLES = Path(__file__).resolve().parents[1] / "tables"


def _cluster(spin_us: float) -> _Proc:
    """The simulated 2P2D cluster, every worker publishing its KV events."""
    args = ["simulator", "cluster", "--topology", "2P2D", "--base-port", "0", "--spin-us", f"{spin_us:g}"]
    return _start(
        [*args, "--kv-events-config", json.dumps(_EVENTS)], env={**os.environ, "PYTHONHASHSEED": _SEED}
    )


def _config(path: Path, workers: Sequence[dict[str, str]], placement: str, decision: str) -> Path:
    """A gateway's settings; `decision` the DecisionService's host:port for mode ppd, "" for mode pd."""

    def table(key: str) -> str:
        return "{ " + ", ".join(f'{w["id"]} = "{w[key]}"' for w in workers) + " }"

    path.write_text(
        f'mode = "{"ppd" if decision else "pd"}"\n'
        + (f'[decision]\naddress = "{decision}"\ndeadline_ms = 1000.0\nfallback = "pd"\n' if decision else "")
        + "".join(
            f'[[workers]]\nid = "{w["id"]}"\nrole = "{w["role"]}"\nurl = "{w["url"]}"\n' for w in workers
        )
        + f'[routing]\nplacement = "{placement}"\n'
        + f"[kv_events]\nendpoints = {table('kv_events')}\nreplay_endpoints = {table('kv_events_replay')}\n"
        + f'hash_seed = "{_SEED}"\nblock_size = 16\n'
        # Generous: on a saturated machine a 3 s connect limit fails requests; this measures cost.
        + "[timeouts]\nconnect_s = 60.0\nidle_s = 600.0\n"
    )
    return path


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one metric family (a counter's by its name without `_total`)."""
    return [
        (dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if s.name in (name, name + "_total")
    ]


def _wait_synced(base: str, workers: int) -> None:
    """Until the gateway follows every worker's event stream (each replayed what it holds)."""
    deadline = time.monotonic() + _SYNC_DEADLINE_S
    while True:
        synced = _samples(_scrape(base + "/metrics"), "ppd_gateway_kv_events_synced")
        if sum(v for _, v in synced) >= workers:
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"the gateway did not sync {workers} workers' KV events in {_SYNC_DEADLINE_S:g} s"
            )
        time.sleep(0.1)


def _opening(tokens: int) -> str:
    """A conversation's first message: unique from its first block on, about `tokens` tokens."""
    return f"conversation {uuid.uuid4().hex}: " + "describe the harbour at dawn, " * max(1, tokens // 7)


async def _phase(
    url: str, histories: list[list[dict[str, str]]], *, turns: int, streams: int, max_tokens: int
) -> tuple[list[float], int]:
    """`turns` more turns of every conversation, `streams` conversations at a time; the TTFTs and how
    many later turns the gateway answered as Turn 1 (their session not continued)."""
    ttfts: list[float] = []
    lost = 0
    queue: asyncio.Queue[list[dict[str, str]]] = asyncio.Queue()
    for history in histories:
        queue.put_nowait(history)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def user() -> None:
            nonlocal lost
            while not queue.empty():
                messages = queue.get_nowait()
                for _ in range(turns):
                    later = len(messages) > 1
                    ttft, _, answer, turn = await _turn(http, url, messages, max_tokens)
                    ttfts.append(ttft)
                    lost += later and turn == "1"
                    messages += [
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": "and then?"},
                    ]

        await asyncio.gather(*(user() for _ in range(streams)))
    return ttfts, lost


def _counters(base: str) -> dict[str, float]:
    """The gateway's placement and /tokenize counters, flat: `prefill/prefix`, ..., `tokenize`."""
    text = _scrape(base + "/metrics")
    out = {f"{labels['role']}/{labels['by']}": v for labels, v in _samples(text, "ppd_gateway_placements")}
    out["tokenize"] = sum(v for _, v in _samples(text, "ppd_gateway_worker_tokenize"))
    return out


async def _tokenize_round_trips(
    url: str, messages: list[dict[str, str]], calls: int
) -> tuple[list[float], list[int]]:
    """`calls` /tokenize calls one after another (seconds each), and the token ids they gave."""
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    times: list[float] = []
    tokens: list[int] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(calls):
            start = time.perf_counter()
            async with http.post(
                url + "/tokenize", data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                tokens = (await resp.json())["tokens"]
            times.append(time.perf_counter() - start)
    return times, tokens


def _tokenize_figure(args: argparse.Namespace, p_url: str) -> dict[str, Any]:
    """Figure 3: the parts of placement's added time alone."""
    messages = [{"role": "user", "content": _opening(args.history_tokens)}]
    for _ in range(args.turns - 1):
        messages += [
            {"role": "assistant", "content": "w " * args.max_tokens},
            {"role": "user", "content": "and then?"},
        ]
    times, tokens = uvloop.run(_tokenize_round_trips(p_url, messages, args.tokenize_calls))
    hasher = BlockHasher(_SEED, block_size=16)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        hasher.chain(tokens)
        best = min(best, time.perf_counter() - start)
    ms = [t * 1000 for t in times]
    return {
        "figure": "tokenize",
        "prompt_tokens": len(tokens),
        "calls": len(times),
        "round_trip_p50_ms": round(_pct(ms, 0.5), 3),
        "round_trip_p99_ms": round(_pct(ms, 0.99), 3),
        "hash_us": round(best * 1e6, 1),
    }


def _memory_figure() -> dict[str, Any]:
    """Figure 4: bytes placement keeps per session and per remembered opening."""
    codec = session_codec(max_id_length=64)
    bare = Session("s" * 32, worker="D0")
    rng = random.Random(7)  # noqa: S311 (token ids to hash, guards nothing)
    sizes: dict[str, dict[str, int]] = {}
    for tokens in (1024, 8192, 32768):
        marks = prefix_marks(
            BlockHasher(_SEED, block_size=16).chain([rng.randrange(128_000) for _ in range(tokens)])
        )
        text = marks_text(marks)
        entry = len(codec.encode(dataclasses.replace(bare, prompt_marks=text))) - len(codec.encode(bare))
        opening = sys.getsizeof(marks) + sum(
            sys.getsizeof(m) + sys.getsizeof(m[0]) + sys.getsizeof(m[1]) for m in marks
        )
        sizes[str(tokens)] = {
            "marks": len(marks),
            "session_store_bytes": entry,
            "session_memory_bytes": sys.getsizeof(text),
            "opening_memory_bytes": opening,
        }
    return {"figure": "memory", "by_prompt_tokens": sizes}


def _ms(value: float | None) -> float | None:
    return round(value * 1000, 3) if value is not None else None


def _measure(args: argparse.Namespace, config: Path, workers: int) -> dict[str, dict[str, Any]]:
    """One arm's round: a fresh gateway, a warm-up, then the Turn 1 phase and the Turn 2+ phase."""
    gw = _start(["gateway", "serve", "--config", str(config), "--port", "0", "--log-level", "WARNING"])
    try:
        base = f"http://127.0.0.1:{gw.ready['http']}"
        url = base + "/v1/chat/completions"
        _wait_synced(base, workers)
        load = {"streams": args.streams, "max_tokens": args.max_tokens}
        warm = [[{"role": "user", "content": _opening(args.history_tokens)}] for _ in range(args.streams)]
        uvloop.run(_phase(url, warm, turns=2, **load))  # connections, caches
        histories = [
            [{"role": "user", "content": _opening(args.history_tokens)}] for _ in range(args.conversations)
        ]
        out: dict[str, dict[str, Any]] = {}
        for phase, turns in (("turn1", 1), ("later", args.turns - 1)):
            hist0, counters0, cpu0 = (
                _histogram(base + "/metrics", _OVERHEAD),
                _counters(base),
                gw.cpu_seconds(),
            )
            ttfts, lost = uvloop.run(_phase(url, histories, turns=turns, **load))
            cpu = gw.cpu_seconds() - cpu0
            hist1, counters1 = _histogram(base + "/metrics", _OVERHEAD), _counters(base)
            out[phase] = _figures(ttfts, lost, cpu, (hist0, hist1), (counters0, counters1))
        return out
    finally:
        gw.stop()


def _figures(
    ttfts: list[float],
    lost: int,
    cpu: float,
    hists: tuple[dict[float, float], dict[float, float]],
    counters: tuple[dict[str, float], dict[str, float]],
) -> dict[str, Any]:
    requests = len(ttfts)
    ms = [t * 1000 for t in ttfts]
    placed = {k: v - counters[0].get(k, 0.0) for k, v in counters[1].items()}
    by_prefix: dict[str, float | None] = {}
    for role in ("prefill", "decode"):
        legs = placed.get(f"{role}/prefix", 0.0) + placed.get(f"{role}/least_loaded", 0.0)
        by_prefix[role] = round(placed.get(f"{role}/prefix", 0.0) / legs, 3) if legs else None
    return {
        "requests": requests,
        "sessions_lost": lost,
        "cpu_us_per_request": round(cpu / requests * 1e6, 1),
        "own_p50_ms": _ms(_quantile(*hists, 0.5)),
        "own_p99_ms": _ms(_quantile(*hists, 0.99)),
        "ttft_p50_ms": round(_pct(ms, 0.5), 3),
        "ttft_p99_ms": round(_pct(ms, 0.99), 3),
        "prefix_share": by_prefix,
        # Legs through P per request: 1 in mode pd; in ppd the share of turns the table sent through P.
        "p_legs_per_request": round(
            (placed.get("prefill/prefix", 0.0) + placed.get("prefill/least_loaded", 0.0)) / requests, 3
        ),
        "tokenize_per_request": round(placed["tokenize"] / requests, 3),
    }


_KEYS = (
    "cpu_us_per_request",
    "own_p50_ms",
    "own_p99_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tokenize_per_request",
)


def _summary(args: argparse.Namespace, results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for arm, phases in results.items():
        medians[arm] = {}
        for phase, rounds in phases.items():
            m: dict[str, float] = {}
            for key in _KEYS:
                values = [r[key] for r in rounds if r.get(key) is not None]
                if values:
                    m[key] = round(statistics.median(values), 4)
            shares = [
                r["prefix_share"]["prefill"] for r in rounds if r["prefix_share"]["prefill"] is not None
            ]
            if shares:
                m["prefix_share_prefill"] = round(statistics.median(shares), 3)
            medians[arm][phase] = m
    ratio: dict[str, dict[str, float | None]] = {}
    for phase in PHASES:
        on, off = medians["prefix"][phase], medians["least_loaded"][phase]
        ratio[phase] = {
            # None where `least_loaded` read nothing (a tiny run: /proc counts 10 ms ticks).
            k: round(on[k] / off[k], 3) if off.get(k) and k in on else None
            for k in _KEYS
            if k != "tokenize_per_request"
        }
    return {
        "figure": "summary",
        "mode": args.mode,
        "rounds": args.rounds,
        "conversations": args.conversations,
        "turns": args.turns,
        "streams": args.streams,
        "history_tokens": args.history_tokens,
        "max_tokens": args.max_tokens,
        "medians": medians,
        "prefix_vs_least_loaded": ratio,
    }


def _run(args: argparse.Namespace) -> int:
    procs = [_cluster(args.worker_spin_us)]
    try:
        workers: list[dict[str, str]] = procs[0].ready["workers"]
        decision = ""
        if args.mode == "ppd":
            serve = [
                "decision_service",
                "serve",
                "--tables",
                str(_TABLES),
                "--port",
                "0",
                "--metrics-port",
                "0",
            ]
            procs.append(_start([*serve, "--log-level", "WARNING"]))
            decision = f"127.0.0.1:{procs[-1].ready['grpc']}"
        with tempfile.TemporaryDirectory() as tmp:
            configs = {arm: _config(Path(tmp) / f"{arm}.toml", workers, arm, decision) for arm in ARMS}
            results: dict[str, dict[str, list[dict[str, Any]]]] = {a: {p: [] for p in PHASES} for a in ARMS}
            with tqdm(total=args.rounds * len(ARMS), desc="placement cost", file=sys.stderr) as bar:
                for r in range(args.rounds):
                    # Alternate which arm goes first: neither always meets the cluster as the other left it.
                    for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                        for phase, figures in _measure(args, configs[arm], len(workers)).items():
                            results[arm][phase].append(figures)
                            _emit({"figure": "arm", "round": r, "arm": arm, "phase": phase, **figures})
                        bar.update()
            _emit(_summary(args, results))
        p_url = next(w["url"] for w in workers if w["role"] == "prefill")
        _emit(_tokenize_figure(args, p_url))
        _emit(_memory_figure())
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.placement", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--rounds", type=int, default=5, help="rounds, each arm once per round (default 5)")
    add("--conversations", type=int, default=48, help="conversations per arm and round (default 48)")
    add(
        "--turns", type=int, default=4, help="turns per conversation, Turn 1 included (default 4; at least 2)"
    )
    add("--streams", type=int, default=8, help="conversations in flight at a time (default 8)")
    add(
        "--history-tokens",
        type=int,
        default=512,
        help="about how many tokens Turn 1's message has (default 512)",
    )
    add("--max-tokens", type=int, default=16, help="tokens per streamed answer (default 16)")
    add(
        "--mode",
        choices=("pd", "ppd"),
        default="pd",
        help="the gateways' mode: pd (every Turn 2+ through P, default) or ppd (a DecisionService on the "
        "shipped tables decides each Turn 2+)",
    )
    add(
        "--worker-spin-us",
        type=float,
        default=0.0,
        help="the simulated workers' --spin-us (default 0: they sleep between steps, so four workers do "
        "not busy-wait on the cores the gateway is measured on; their timing is then to the millisecond)",
    )
    add(
        "--tokenize-calls", type=int, default=200, help="/tokenize calls of the tokenize figure (default 200)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.turns < 2:
        raise SystemExit("--turns must be at least 2: Turn 2+ is what placement finds a prefix for")
    if min(args.rounds, args.conversations, args.streams, args.tokenize_calls) < 1:
        raise SystemExit("--rounds, --conversations, --streams and --tokenize-calls must be at least 1")
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""The gateway's KV-event tracking cost: CPU per 1k events, memory per 100k resident blocks, and the
per-request hashing of a prompt (gateway/residency.py, ppd/kv_events.py).

    python -m benchmarks.kv_events [--small] [--json FILE]

In process, single thread: the work the subscriber does per message (decode the msgpack batch, apply
it to the worker's resident set) on a stream shaped like vLLM's (per step one BlockStored of a few
16-token blocks, then BlockRemoved evictions once the budget is reached), timed with CPU time
(``time.process_time``); the memory of a worker's resident set measured with tracemalloc; and the
hash chain of a prompt (what the request path adds per Turn 2+ request besides the /tokenize call).
Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.residency import Residency
from ppd.kv_events import BlockHasher, BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

__all__ = ["BenchConfig", "cpu_per_1k_events", "hash_prompt", "main", "memory_per_100k_blocks"]


@dataclass(frozen=True, slots=True)
class BenchConfig:
    events: int = 200_000  # events in the timed stream
    blocks_per_store: int = 4  # full blocks a request caches per step
    resident_blocks: int = 100_000  # for the memory figure
    prompt_tokens: int = 8192  # for the hashing figure
    seed: int = 0

    @classmethod
    def small(cls) -> BenchConfig:
        return cls(events=2_000, resident_blocks=2_000, prompt_tokens=512)


def _stream(cfg: BenchConfig, budget: int) -> list[tuple[int, bytes]]:
    """(seq, payload) of batches: each store of ``blocks_per_store`` blocks, evictions past ``budget``."""
    rng = random.Random(cfg.seed)  # noqa: S311 - synthetic data, not crypto
    out: list[tuple[int, bytes]] = []
    resident: list[int] = []
    events = 0
    parent: int | None = None
    while events < cfg.events:
        hashes = tuple(rng.getrandbits(64) for _ in range(cfg.blocks_per_store))
        tokens = tuple(rng.randrange(128_000) for _ in range(16 * cfg.blocks_per_store))
        batch_events: list[BlockStored | BlockRemoved] = [
            BlockStored(hashes, parent, tokens, 16, extra={"group_idx": 0})
        ]
        parent = hashes[-1]
        resident.extend(hashes)
        while len(resident) > budget:
            batch_events.append(BlockRemoved((resident.pop(0),), extra={"group_idx": 0}))
        events += len(batch_events)
        out.append((len(out), encode_batch(EventBatch(time.time(), tuple(batch_events), 0))))
    return out


def cpu_per_1k_events(cfg: BenchConfig) -> dict[str, float]:
    budget = max(1, cfg.events // 4)
    stream = _stream(cfg, budget)
    n_events = 0
    residency = Residency(["D0"], max_blocks=budget * 2)
    start = time.process_time()
    for seq, payload in stream:
        batch = decode_batch(payload)
        n_events += len(batch.events)
        residency.apply("D0", seq, batch)
    cpu = time.process_time() - start
    return {"events": n_events, "cpu_s": cpu, "cpu_ms_per_1k_events": 1000.0 * cpu * 1000 / n_events}


def memory_per_100k_blocks(cfg: BenchConfig) -> dict[str, float]:
    rng = random.Random(cfg.seed)  # noqa: S311 - synthetic data, not crypto
    n = cfg.resident_blocks
    hashes = tuple(rng.getrandbits(64) for _ in range(n))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    residency = Residency(["D0"], max_blocks=n)
    for seq, i in enumerate(range(0, n, 64)):
        residency.apply("D0", seq, EventBatch(0.0, (BlockStored(hashes[i : i + 64], None, (), 16),), 0))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert residency.tracked_blocks("D0") == n
    per_block = (after - before) / n
    return {"blocks": n, "bytes": after - before, "mib_per_100k_blocks": per_block * 100_000 / 2**20}


def hash_prompt(cfg: BenchConfig) -> dict[str, float]:
    rng = random.Random(cfg.seed)  # noqa: S311 - synthetic data, not crypto
    tokens = [rng.randrange(128_000) for _ in range(cfg.prompt_tokens)]
    hasher = BlockHasher(block_size=16)
    rounds = 20
    start = time.process_time()
    for _ in range(rounds):
        hasher.chain(tokens)
    cpu = (time.process_time() - start) / rounds
    return {
        "prompt_tokens": cfg.prompt_tokens,
        "ms_per_prompt": cpu * 1000,
        "us_per_block": cpu * 1e6 * 16 / len(tokens),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kv_events", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--small", action="store_true", help="a tiny run (the CI test's size)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = parser.parse_args(argv)
    cfg = BenchConfig.small() if args.small else BenchConfig()
    figures = {"cpu": cpu_per_1k_events(cfg), "memory": memory_per_100k_blocks(cfg), "hash": hash_prompt(cfg)}
    c, m, h = figures["cpu"], figures["memory"], figures["hash"]
    print(f"event tracking: {c['cpu_ms_per_1k_events']:.2f} ms CPU per 1k events ({int(c['events'])} events)")
    print(
        f"resident set: {m['mib_per_100k_blocks']:.2f} MiB per 100k blocks "
        f"({int(m['blocks'])} blocks measured)"
    )
    print(
        f"prompt hashing: {h['ms_per_prompt']:.2f} ms per {int(h['prompt_tokens'])}-token prompt "
        f"({h['us_per_block']:.1f} us per 16-token block)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

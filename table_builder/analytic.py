"""A closed-form queueing model of a P/D cluster that writes plausible benchmark records, seeded.

It is NOT the simulator (``simulator/`` is the calibrated, virtual-time stand-in for vLLM workers); it
exists so the table builder's own pipeline (sweep, resume, build, the shipped example table) can run and
be tested without any other component. Figures are in the range of Llama-3.1-8B on H100 and follow the
paper's shape: PD pays a full re-prefill of the context plus a KV transfer, and its single prefill
worker saturates as QPS grows (requests then time out); local append-prefill is fast but slows the
decode batch it joins, more so for long pasted inputs.

Model, per grid point (``qps`` = two-turn conversations per second, split over the workers):

- prefill time ``8 ms + tokens / 12 per ms``; KV transfer ``2 ms + 0.006 ms/token``;
- P utilisation rho = qps x (Turn-1 prefill [+ Turn-2 full prefill under pd]) / #P; waiting time
  M/D/1 ``rho / (2 (1 - rho)) x service``; above rho = 0.97 the excess share of requests time out;
- TPOT ``7 ms + 0.04 ms x running decodes per D``, inflated under local by the share of decode steps
  that carry an append-prefill;
- every figure gets log-normal noise (sigma 0.08) from ``random.Random(seed)``.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from table_builder.records import Record
from table_builder.sweep import GridPoint

__all__ = ["AnalyticEngine", "parse_shape"]

_SHAPE: Final = re.compile(r"^(\d+)P(\d+)D$")
_TIMEOUT_MS: Final = 30_000.0
_NOISE: Final = 0.08
# 2026-01-01T00:00:00Z: records carry Unix start times, offset deterministically from here.
_EPOCH: Final = 1_767_225_600.0


def parse_shape(shape: str) -> tuple[int, int]:
    """``"1P3D"`` -> (1 prefill worker, 3 decode workers)."""
    m = _SHAPE.match(shape)
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"deployment shape {shape!r} is not <n>P<m>D with n, m >= 1")
    return int(m.group(1)), int(m.group(2))


def _prefill_ms(tokens: int) -> float:
    return 8.0 + tokens / 12.0


def _transfer_ms(tokens: int) -> float:
    return 2.0 + 0.006 * tokens


@dataclass(frozen=True, slots=True)
class AnalyticEngine:
    """Two-turn conversations per grid point: ``conversations`` of them, or QPS x ``duration_s``."""

    conversations: int = 20
    duration_s: float | None = None
    seed: int = 0

    @property
    def name(self) -> str:
        return "analytic"

    def settings(self) -> Mapping[str, Any]:
        return {"conversations": self.conversations, "duration_s": self.duration_s, "seed": self.seed}

    def run(self, point: GridPoint) -> list[Record]:
        n_p, n_d = parse_shape(point.shape)
        wl, q = point.workload, point.qps
        t1, t2 = wl.first, wl.second
        ctx = wl.turn2_context
        pd = point.mode == "pd"
        if point.mode not in ("pd", "local"):
            raise ValueError(f"the analytic engine models static pd and local runs, not {point.mode!r}")
        rng = random.Random(f"{self.seed}/{point.run_id}")  # noqa: S311 (reproducible noise, not secrets)

        turn1_service = _prefill_ms(t1.n_in)
        turn2_service = _prefill_ms(ctx + t2.n_in) if pd else 0.0
        rho = q * (turn1_service + turn2_service) / 1000.0 / n_p
        service = (turn1_service + turn2_service) / (2.0 if pd else 1.0)
        wait = service * min(rho, 0.97) / (2.0 * (1.0 - min(rho, 0.97)))
        fail = max(0.0, 1.0 - 0.97 / rho) if rho > 0.97 else 0.0

        running = q * (t1.n_out + t2.n_out) * 0.009 / n_d
        append_share = 0.0 if pd else min(0.9, q * _prefill_ms(t2.n_in) / 1000.0 / n_d)
        base_tpot = 7.0 + 0.04 * running
        tpot2 = base_tpot * (1.0 + (0.0 if pd else 0.6 * append_share + 0.0003 * t2.n_in))
        ttft1 = wait + turn1_service + _transfer_ms(t1.n_in) + base_tpot
        if pd:
            ttft2 = wait + _prefill_ms(ctx + t2.n_in) + _transfer_ms(ctx + t2.n_in) + tpot2
        else:
            ttft2 = 0.5 * base_tpot + _prefill_ms(t2.n_in) * (1.0 + append_share) + 3.0

        count = self.conversations if self.duration_s is None else max(1, round(q * self.duration_s))
        records: list[Record] = []
        start = _EPOCH
        for i in range(count):
            start += rng.expovariate(q)
            cid = f"{point.run_id}-c{i:03d}"
            # Turn 1 always goes through P; a conversation whose Turn 1 failed has no Turn 2.
            first = self._record(
                point,
                rng,
                cid=cid,
                turn=1,
                n_in=t1.n_in,
                n_out=t1.n_out,
                n_ctx=0,
                ttft=ttft1,
                tpot=base_tpot,
                fail=fail,
                start=start,
            )
            records.append(first)
            if not first.ok or first.e2e_ms is None:
                continue
            records.append(
                self._record(
                    point,
                    rng,
                    cid=cid,
                    turn=2,
                    n_in=t2.n_in,
                    n_out=t2.n_out,
                    n_ctx=ctx,
                    ttft=ttft2,
                    tpot=tpot2,
                    fail=fail if pd else 0.0,
                    start=start + first.e2e_ms / 1000.0 + 1.0,
                )
            )
        return records

    def _record(
        self,
        point: GridPoint,
        rng: random.Random,
        *,
        cid: str,
        turn: int,
        n_in: int,
        n_out: int,
        n_ctx: int,
        ttft: float,
        tpot: float,
        fail: float,
        start: float,
    ) -> Record:
        failed = rng.random() < fail
        ttft_ms = tpot_ms = e2e_ms = None
        if not failed:
            ttft_ms = round(ttft * math.exp(rng.gauss(0.0, _NOISE)), 3)
            tpot_ms = round(tpot * math.exp(rng.gauss(0.0, _NOISE)), 3)
            e2e_ms = round(ttft_ms + tpot_ms * max(n_out - 1, 0), 3)
        return Record(
            run_id=point.run_id,
            shape=point.shape,
            model=point.model,
            mode=point.mode,
            target_qps=float(point.qps),
            workload=point.workload.name,
            conversation_id=cid,
            turn=turn,
            n_in=n_in,
            n_out=n_out,
            n_ctx=n_ctx,
            path="pd" if point.mode == "pd" or turn == 1 else "local",
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            e2e_ms=e2e_ms,
            ok=not failed,
            error=f"timeout after {_TIMEOUT_MS / 1000:g} s" if failed else None,
            start_time=round(start, 6),
        )

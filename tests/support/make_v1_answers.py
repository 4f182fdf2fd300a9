"""Record what a format-version-1 server answered, for the compatibility test (issue 17).

    python -m tests.support.make_v1_answers      # writes tests/testdata/tables/good.v1-answers.jsonl

Run once, on the code before format version 2 existed (commit 13feab8), against ``good.ppdt`` (a
version-1 file). Each line holds a RouteRequest and the RouteResponse that code gave, both as hex of
their serialised bytes; the last line holds the DescribeTable answer. Do not regenerate it: the file is
the record of the old behaviour that ``tests/decision_service/test_compat_v1.py`` compares with.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from decision_service.holder import TableSet
from decision_service.route import Router, check_query
from decision_service.servicer import _describe, _query, _response
from decision_service.table import Table
from ppd.decision.v1 import decision_pb2 as pb

TABLES = Path(__file__).resolve().parents[1] / "testdata" / "tables"
GOOD = TABLES / "good.ppdt"
ANSWERS = TABLES / "good.v1-answers.jsonl"


def requests(seed: int = 17, count: int = 600) -> list[pb.RouteRequest]:
    """Queries over every cell, turn 1, weights, profiles and live signals (seeded)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        req = pb.RouteRequest(
            request_id=f"r{i}",
            turn=1 if i % 10 == 0 else rng.randint(2, 9),
            new_input_tokens=rng.choice([0, 5, 30, 100, 300, 900, 3000, rng.randint(0, 20000)]),
            expected_output_tokens=rng.choice([0, 10, 60, 200, 700, 2000, rng.randint(0, 5000)]),
            context_tokens=rng.choice([0, 100, 1000, 4000, 9000, 30000, 200000, rng.randint(0, 300000)]),
            qps=rng.choice([0.0, 0.5, 1.0, 2.0, 4.0, 7.0, 10.0, 16.0, 24.0, 60.0, rng.uniform(0, 40)]),
        )
        kind = rng.random()
        if kind < 0.2:
            req.weights.w_ttft, req.weights.w_tpot = rng.choice(
                [(1.0, 0.2), (0.05, 1.0), (1.0, 0.0), (0.3, 0.7)]
            )
        elif kind < 0.4:
            req.weights_profile = rng.choice(["ttft", "tpot", "balanced"])
        if rng.random() < 0.3:
            req.live.decode_kv_usage = rng.choice([0.1, 0.5, 0.97, 1.0])
        if rng.random() < 0.2:
            req.live.decode_running_requests = rng.randint(0, 400)
            req.live.prefill_queue_depth = rng.randint(0, 20)
        out.append(req)
    return out


def main() -> None:
    table = Table.open(GOOD)
    router = Router(table)
    tables = TableSet(routers={table.key: router}, default_key=table.key, default=router)
    lines = []
    for req in requests():
        query = _query(req)
        check_query(query, table)
        resp = _response(router.route(query), table, req.request_id)
        lines.append({"request": req.SerializeToString().hex(), "response": resp.SerializeToString().hex()})
    lines.append({"describe": _describe(router, tables).SerializeToString().hex()})
    ANSWERS.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


if __name__ == "__main__":
    main()

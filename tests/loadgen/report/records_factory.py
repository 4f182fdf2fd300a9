"""Small, plausible record sets for the report tests (PPD beats PD on Turn 2+ TTFT, PD fails at load)."""

from __future__ import annotations

import random

from loadgen.report.comparison import Manifest, RunInfo
from table_builder.records import Record

QPS = (1.0, 4.0, 12.0)


def _records(
    run_id: str,
    shape: str,
    mode: str,
    qps: float,
    *,
    ttft2: float,
    tpot: float,
    fail: float,
    local: float,
    rng: random.Random,
    n: int = 12,
) -> list[Record]:
    out = []
    for i in range(n):
        start = i / qps
        for turn in (1, 2):
            ok = not (turn == 2 and rng.random() < fail)
            ttft = (120.0 if turn == 1 else ttft2) * rng.uniform(0.9, 1.1)
            path = "pd" if turn == 1 or rng.random() >= local else "local"
            out.append(
                Record(
                    run_id=run_id,
                    shape=shape,
                    model="llama-3.1-8b",
                    mode=mode,
                    target_qps=qps,
                    workload="sharegpt",
                    conversation_id=f"{run_id}-{i}",
                    turn=turn,
                    n_in=50,
                    n_out=100,
                    n_ctx=0 if turn == 1 else 300,
                    path=path,
                    ttft_ms=ttft if ok else None,
                    tpot_ms=tpot if ok else None,
                    e2e_ms=ttft + 99 * tpot if ok else None,
                    ok=ok,
                    error=None if ok else "timeout after 30 s",
                    start_time=start + (turn - 1) * 2.0,
                )
            )
    return out


def paper_like(seed: int = 0) -> tuple[list[Record], Manifest]:
    rng = random.Random(seed)
    records: list[Record] = []
    runs: dict[str, RunInfo] = {}
    for shape in ("1P3D", "2P2D"):
        for qps in QPS:
            load = qps / 12.0
            records += _records(
                f"{shape}-pd-{qps}",
                shape,
                "pd",
                qps,
                ttft2=150 + 300 * load,
                tpot=8.0,
                fail=0.2 * load if qps >= 12 else 0.0,
                local=0.0,
                rng=rng,
            )
            records += _records(
                f"{shape}-local-{qps}",
                shape,
                "local",
                qps,
                ttft2=45.0,
                tpot=9.5,
                fail=0.0,
                local=1.0,
                rng=rng,
            )
            records += _records(
                f"{shape}-ppd-{qps}", shape, "ppd", qps, ttft2=50.0, tpot=8.4, fail=0.0, local=0.8, rng=rng
            )
    for w, share in ((1.0, 0.95), (3.0, 0.5), (6.0, 0.2)):
        run = f"wtpot-{w:g}"
        runs[run] = RunInfo(experiment="wtpot", w_tpot=w)
        records += _records(
            run,
            "1P3D",
            "ppd",
            4.0,
            ttft2=50 + 100 * (1 - share),
            tpot=9.5 - 1.5 * (1 - share),
            fail=0.0,
            local=share,
            rng=rng,
        )
    for gbs, name in ((150.0, "NVLink"), (25.0, "IB HDR"), (10.0, "100GbE")):
        for mode, ttft2 in (("pd", 140 + 300 / gbs), ("ppd", 51.0)):
            run = f"link-{mode}-{gbs:g}"
            runs[run] = RunInfo(experiment="bandwidth", link_gb_s=gbs, link=name)
            records += _records(
                run,
                "1P3D",
                mode,
                1.0,
                ttft2=ttft2,
                tpot=8.1,
                fail=0.0,
                local=0.0 if mode == "pd" else 1.0,
                rng=rng,
                n=6,
            )
    return records, Manifest(engine="test factory", seed=seed, runs=runs)

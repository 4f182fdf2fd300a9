"""``ppd-table import-vllm-bench``: vLLM's own benchmark outputs -> benchmark records (``vllm_bench.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

__all__ = ["add_parser"]

logger = logging.getLogger("table_builder")


def _cmd_import_vllm_bench(args: argparse.Namespace) -> int:
    from table_builder.records import write_records
    from table_builder.vllm_bench import RunLabels, VllmBenchError, read_vllm_bench

    try:
        labels = RunLabels(
            shape=args.shape,
            model=args.model,
            mode=args.mode,
            qps=args.qps,
            context_tokens=args.context_tokens,
            workload=args.workload,
        )
        got = read_vllm_bench(args.files, labels)
    except VllmBenchError as exc:
        logger.error("%s", exc)
        return 1
    write_records(args.out, got.records)
    later = sum(r.turn > 1 for r in got.records)
    for note in got.caveats:
        print(f"note: {note}", file=sys.stderr)
    if not later:
        print(
            "note: every record is Turn 1, which tables leave out; for a vllm bench serve run whose prompts "
            "begin with a shared prefix standing for a previous turn, give --context-tokens N",
            file=sys.stderr,
        )
    if args.json:
        summary = {
            "out": str(args.out),
            "records": len(got.records),
            "turn2plus": later,
            "files": [dataclasses.asdict(f) for f in got.files],
            "caveats": list(got.caveats),
        }
        print(json.dumps(summary))
        return 0
    for f in got.files:
        print(f"{f.path}: {f.format}, {len(f.runs)} run(s), {f.requests} requests ({f.failed} failed)")
    print(f"wrote {args.out}: {len(got.records)} records ({later} of Turn 2+)")
    return 0


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """The ``import-vllm-bench`` sub-command (``table_builder/vllm_bench.py``)."""
    vbench = sub.add_parser(
        "import-vllm-bench",
        parents=[common],
        help="vLLM's own benchmark outputs -> benchmark records (JSONL) for build and refresh",
        description="Read `vllm bench serve --save-result --save-detailed` results (one JSON object per "
        "run, or one per line with --append-result) or the multi-turn benchmark's --stats-json-output "
        "array (told apart by content) and write one record per request. The files do not say the "
        "deployment shape, the table's model label or the mode: give them here. "
        "docs/vllm-protocol.md 6.4 and 7.2 give the mapping.",
    )
    vbench.add_argument("files", type=Path, nargs="+", metavar="FILE", help="vLLM benchmark output files")
    vbench.add_argument(
        "--mode", required=True, choices=("pd", "local"), help="the static mode the run measured"
    )
    vbench.add_argument("--shape", required=True, help="deployment shape the run measured, e.g. 1P3D")
    vbench.add_argument("--model", required=True, help="the table's model label, e.g. llama-3.1-8b")
    vbench.add_argument(
        "--qps",
        type=float,
        help="load level to file the runs under (default: vllm bench serve's request_rate; required for "
        "request_rate inf and for multi-turn stats)",
    )
    vbench.add_argument(
        "--context-tokens",
        type=int,
        default=0,
        metavar="N",
        help="vllm bench serve only: every prompt starts with an N-token shared prefix standing for a "
        "previous turn (e.g. --random-prefix-len N), so each request is a Turn 2 with N tokens of "
        "context (default 0: Turn 1, which tables leave out)",
    )
    vbench.add_argument("--workload", help="workload label of the records (default: the format's name)")
    vbench.add_argument("--out", type=Path, required=True, help="records JSONL to write (atomically)")
    vbench.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    vbench.set_defaults(run=_cmd_import_vllm_bench)

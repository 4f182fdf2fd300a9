"""vLLM's own benchmark outputs -> benchmark records (``ppd-table import-vllm-bench``;
``docs/vllm-protocol.md`` 6.4 and 7.2).

Two formats, told apart by their content (not their names):

- ``vllm bench serve --save-result --save-detailed``: a JSON object per run (``--append-result`` puts
  one per line in the same file), read by ``vllm_serve.py``;
- the multi-turn benchmark's ``--stats-json-output``: a JSON array of per-turn objects, read by
  ``vllm_multi_turn.py``.

Rules:

1. Whatever the file does not say comes from :class:`RunLabels` (``vllm_run.py``); a run whose load
   level is unknown (``request_rate`` ``inf``, or any multi-turn file) needs an explicit QPS, and a QPS
   that contradicts the file's own ``request_rate`` is refused.
2. A file that is not one of the two formats, is cut short, is damaged, or lacks the per-request data
   is refused with its path and the reason (and the vLLM flag that would have written the data); the
   same content given twice is refused too. Every bad file is listed, none is skipped.
3. Deterministic: the records follow the files' order and content only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from table_builder.records import Record
from table_builder.vllm_multi_turn import MISSING, read_multi_turn_stats
from table_builder.vllm_run import RunLabels, VllmBenchError, to_record
from table_builder.vllm_serve import read_serve_result

__all__ = ["FORMATS", "ImportedFile", "RunLabels", "VllmBenchError", "VllmBenchImport", "read_vllm_bench"]

SERVE: Final = "vllm bench serve"
MULTI_TURN: Final = "vllm multi-turn"
#: The formats read, by the name the summary prints.
FORMATS: Final = (SERVE, MULTI_TURN)

#: The ``workload`` label of the records unless ``RunLabels.workload`` says otherwise.
_DEFAULT_WORKLOAD: Final = {SERVE: "vllm-bench-serve", MULTI_TURN: "vllm-multi-turn"}


@dataclass(frozen=True, slots=True)
class ImportedFile:
    path: str
    format: str
    runs: tuple[str, ...]
    requests: int
    failed: int


@dataclass(frozen=True, slots=True)
class VllmBenchImport:
    """The records of every file, what each file held, and what the formats cannot tell."""

    records: tuple[Record, ...]
    files: tuple[ImportedFile, ...]
    #: One line per limitation of a format present in the inputs (e.g. failures not recorded).
    caveats: tuple[str, ...]


def read_vllm_bench(paths: Iterable[str | Path], labels: RunLabels) -> VllmBenchImport:
    """Every request of the given files as records; :class:`VllmBenchError` lists every bad file."""
    records: list[Record] = []
    files: list[ImportedFile] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    for raw in paths:
        path = Path(raw)
        try:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                raise VllmBenchError(f"{path}: the same content as {seen[digest]} (a run given twice?)")
            seen[digest] = str(path)
            got, info = _read_file(path, data, labels)
        except VllmBenchError as exc:
            problems.append(str(exc))
            continue
        except OSError as exc:
            problems.append(f"{path}: cannot read: {exc.strerror or exc}")
            continue
        records.extend(got)
        files.append(info)
    if problems:
        raise VllmBenchError("\n".join(problems))
    caveats = (f"{MULTI_TURN}: {MISSING}",) if any(f.format == MULTI_TURN for f in files) else ()
    return VllmBenchImport(records=tuple(records), files=tuple(files), caveats=caveats)


def _read_file(path: Path, data: bytes, labels: RunLabels) -> tuple[list[Record], ImportedFile]:
    records: list[Record] = []
    runs: list[str] = []
    kinds: set[str] = set()
    for where, doc in _documents(path, data):
        kind = _kind(doc, where=where)
        kinds.add(kind)
        if kind == SERVE:
            run = read_serve_result(doc, context_tokens=labels.context_tokens, where=where)
            run_id, requests = run.run_id, run.requests
            qps = _serve_qps(run.request_rate, labels.qps, where=where)
        else:
            if labels.context_tokens:
                raise VllmBenchError(
                    f"{where}: --context-tokens is for vllm bench serve results; the multi-turn benchmark "
                    "records each turn's own context"
                )
            if labels.qps is None:
                raise VllmBenchError(
                    f"{where}: the multi-turn benchmark's stats do not record the load level: give --qps "
                    "(the QPS level this run stands for)"
                )
            run_id, requests, qps = path.stem, read_multi_turn_stats(doc, where=where), labels.qps
        workload = labels.workload or _DEFAULT_WORKLOAD[kind]
        runs.append(run_id)
        records.extend(
            to_record(
                r, labels, run_id=run_id, target_qps=qps, workload=workload, where=f"{where}: request {i}"
            )
            for i, r in enumerate(requests)
        )
    if len(kinds) > 1:
        raise VllmBenchError(f"{path}: mixes {' and '.join(sorted(kinds))} outputs in one file")
    info = ImportedFile(
        path=str(path),
        format=kinds.pop(),
        runs=tuple(runs),
        requests=len(records),
        failed=sum(not r.ok for r in records),
    )
    return records, info


def _serve_qps(file_rate: float | None, given: float | None, *, where: str) -> float:
    if given is None:
        if file_rate is None:
            raise VllmBenchError(
                f"{where}: request_rate is inf (every request sent at once): there is no load level to "
                "file the run under; give --qps"
            )
        return file_rate
    if file_rate is not None and file_rate != given:
        raise VllmBenchError(f"{where}: the run's request_rate is {file_rate:g} but --qps says {given:g}")
    return given


def _documents(path: Path, data: bytes) -> list[tuple[str, Any]]:
    """The JSON document(s) of a file: one (a result object, a stats array) or, for an
    ``--append-result`` file, one object per line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VllmBenchError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise VllmBenchError(f"{path}: empty file")
    try:
        return [(str(path), json.loads(text))]
    except json.JSONDecodeError as exc:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
        if not (text.lstrip().startswith("{") and len(lines) > 1):
            raise VllmBenchError(
                f"{path}: invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                + _cut_short(exc.pos, text)
            ) from None
    docs: list[tuple[str, Any]] = []
    for n, line in lines:
        try:
            docs.append((f"{path}: line {n}", json.loads(line)))
        except json.JSONDecodeError as exc:
            last = n == lines[-1][0]
            raise VllmBenchError(
                f"{path}: line {n}: invalid JSON: {exc.msg} at column {exc.colno}"
                + (_cut_short(exc.pos, line) if last else "")
            ) from None
    return docs


def _cut_short(pos: int, text: str) -> str:
    if pos >= len(text.rstrip()):
        return " (the file ends in the middle of the JSON: cut short by an interrupted run or copy?)"
    return ""


def _kind(doc: object, *, where: str) -> str:
    if isinstance(doc, dict):
        return SERVE
    if isinstance(doc, list):
        first = doc[0] if doc else None
        if isinstance(first, dict) and "messages" in first:
            raise VllmBenchError(
                f"{where}: this is the multi-turn benchmark's conversations output (--output-file); the "
                "per-request figures are in the file of --stats-json-output"
            )
        if isinstance(first, dict) and "benchmark" in first and "metric" in first:
            raise VllmBenchError(
                f"{where}: this is the PyTorch-format summary (*.pytorch.json) of vllm bench serve; give "
                "the result JSON written with --save-result --save-detailed"
            )
        return MULTI_TURN
    raise VllmBenchError(
        f"{where}: not a vLLM benchmark output: expected a vllm bench serve result object or the "
        f"multi-turn benchmark's --stats-json-output array, got a JSON {type(doc).__name__}"
    )

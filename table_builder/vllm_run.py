"""One vLLM benchmark run as benchmark records: what the file does not say, one request in neutral form,
and the error of reading one (``docs/vllm-protocol.md`` 6.4 and 7.2).

The format modules (``vllm_serve.py``, ``vllm_multi_turn.py``) read vLLM's files into
:class:`BenchRequest` values; :func:`to_record` adds the :class:`RunLabels` the user gives on the
command line and checks the result against the record schema. ``vllm_bench.py`` reads files and picks
the format.

Rules:

1. vLLM's benchmarks do not record the deployment shape, our model label, the routing mode or (for the
   multi-turn benchmark) the load level: the user states them (:class:`RunLabels`); nothing is guessed.
2. Only static runs can be imported: ``pd`` or ``local``, and every request's path is that mode. A
   benchmark client cannot see which path a ``ppd`` gateway chose (the gateway's request log can).
3. A value that is not a finite number of the right kind is an error naming the file, the request and
   the field; nothing is skipped silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from ppd.records import Record, RecordError

__all__ = [
    "IMPORTABLE_MODES",
    "BenchRequest",
    "RunLabels",
    "VllmBenchError",
    "finite_number",
    "non_negative_int",
    "to_record",
]

#: The modes a benchmark client's file can honestly stand for (rule 2).
IMPORTABLE_MODES: Final = ("pd", "local")


class VllmBenchError(ValueError):
    """A vLLM benchmark file cannot be read as records; the message names the file and what is wrong
    (and, where a rerun fixes it, the flag to rerun with)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLabels:
    """What a vLLM benchmark file does not say, given on our command line (rule 1)."""

    shape: str
    #: The table's model label (e.g. ``llama-3.1-8b``), not vLLM's model id.
    model: str
    #: ``pd`` or ``local`` (rule 2).
    mode: str
    #: The load level to file the run under; ``None``: take it from the file (``vllm bench serve``'s
    #: ``request_rate``).
    qps: float | None = None
    #: ``vllm bench serve`` only: the first N prompt tokens of every request are a previous turn's
    #: context (a shared prefix), which makes each request a Turn 2 with ``n_ctx = N``; 0: Turn 1.
    context_tokens: int = 0
    #: The records' ``workload`` label; ``None``: the format's own name.
    workload: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in IMPORTABLE_MODES:
            raise VllmBenchError(
                f"mode {self.mode!r} cannot be imported: a vLLM benchmark file does not say which path "
                "each request took, so only static pd or local runs can be read (for ppd runs, use the "
                "gateway's request log)"
            )
        for name in ("shape", "model"):
            if not getattr(self, name):
                raise VllmBenchError(f"{name} must not be empty")
        if self.workload is not None and not self.workload:
            raise VllmBenchError("workload must not be empty")
        if self.qps is not None and not (math.isfinite(self.qps) and self.qps > 0):
            raise VllmBenchError(f"qps must be a finite number > 0, got {self.qps!r}")
        if self.context_tokens < 0:
            raise VllmBenchError(f"context tokens must be >= 0, got {self.context_tokens}")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRequest:
    """One request as a format module read it, before the run's labels are added."""

    conversation_id: str
    turn: int
    n_in: int
    n_out: int
    n_ctx: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    #: ``None``: completed.
    error: str | None
    #: Seconds since the run's first request was sent (vLLM's clocks are monotonic, not calendar time).
    start_s: float


def to_record(
    request: BenchRequest, labels: RunLabels, *, run_id: str, target_qps: float, workload: str, where: str
) -> Record:
    """The record of one request; a :class:`VllmBenchError` at ``where`` when the schema refuses it."""
    ok = request.error is None
    try:
        return Record(
            run_id=run_id,
            shape=labels.shape,
            model=labels.model,
            mode=labels.mode,
            target_qps=target_qps,
            workload=workload,
            conversation_id=request.conversation_id,
            turn=request.turn,
            n_in=request.n_in,
            n_out=request.n_out,
            n_ctx=request.n_ctx,
            path=labels.mode,
            ttft_ms=request.ttft_ms if ok else None,
            tpot_ms=request.tpot_ms if ok else None,
            e2e_ms=request.e2e_ms if ok else None,
            ok=ok,
            error=request.error,
            start_time=request.start_s,
        )
    except RecordError as exc:
        raise VllmBenchError(f"{where}: {exc.reason}") from None


def finite_number(value: object, *, where: str) -> float:
    """A JSON number (int or float, not a bool) that is finite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise VllmBenchError(f"{where}: expected a number, got {_json_type(value)} {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise VllmBenchError(f"{where}: expected a finite number, got {value!r}")
    return number


def non_negative_int(value: object, *, where: str) -> int:
    """A JSON integer >= 0 (``3.0`` and ``true`` are refused)."""
    if type(value) is not int:
        raise VllmBenchError(f"{where}: expected a whole number, got {_json_type(value)} {value!r}")
    if value < 0:
        raise VllmBenchError(f"{where}: expected a number >= 0, got {value}")
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return {"str": "string", "list": "array", "dict": "object"}.get(
        type(value).__name__, type(value).__name__
    )

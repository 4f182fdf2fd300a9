"""``vllm bench serve --save-result --save-detailed`` result objects -> requests (``docs/vllm-protocol.md``
7.1-7.2 define the format and the mapping).

Rules:

1. Per-request figures exist only with ``--save-detailed``: without it vLLM deletes ``input_lens``,
   ``output_lens``, ``start_times``, ``ttfts``, ``itls``, ``generated_texts`` and ``errors`` before
   writing, and such a file is refused with the flag to rerun with. Summary means are never turned into
   requests.
2. The per-request lists are parallel (index i is one request) and must agree with each other and with
   the run's ``completed`` / ``failed`` counts; a file that disagrees is refused as damaged.
3. A request completed when vLLM recorded no error and a first token (``ttfts[i] > 0``), as vLLM itself
   decides ``success``; TPOT is vLLM's own per-request figure, (latency - TTFT) / (output tokens - 1),
   none for answers of one token.
4. ``vllm bench serve`` is single-turn: each request is its own conversation, Turn 1, unless the user
   declares a shared prefix of N context tokens (``RunLabels.context_tokens``), which makes every
   request a Turn 2 with ``n_ctx = N`` and ``n_in = input_lens[i] - N``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from table_builder.vllm_run import BenchRequest, VllmBenchError, finite_number, non_negative_int

__all__ = ["DETAILED_FIELDS", "ServeRun", "read_serve_result"]

#: The per-request lists ``--save-detailed`` keeps (rule 1), all required.
DETAILED_FIELDS: Final = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "errors")

#: Fields only pooling (embedding, rerank) runs write: they generate no tokens.
_POOLING_ONLY: Final = ("total_input_sequences", "input_sequence_throughput")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeRun:
    """One ``vllm bench serve`` run: its name, its configured request rate and its requests."""

    #: vLLM's own result-file name without ``.json``: ``{label}-{rate}qps[-concurrency{n}]-{model}-{date}``.
    run_id: str
    #: ``request_rate`` of the run; ``None`` when it was ``"inf"`` (every request sent at once).
    request_rate: float | None
    requests: tuple[BenchRequest, ...]


def read_serve_result(result: Mapping[str, Any], *, context_tokens: int, where: str) -> ServeRun:
    """One result object (one line of an ``--append-result`` file) -> its requests."""
    if any(name in result for name in _POOLING_ONLY):
        raise VllmBenchError(
            f"{where}: a pooling benchmark (backend {result.get('backend')!r}) generates no tokens: "
            "there are no TTFT or TPOT figures to import"
        )
    missing = [name for name in DETAILED_FIELDS if name not in result]
    if len(missing) == len(DETAILED_FIELDS):
        raise VllmBenchError(
            f"{where}: no per-request data: this result was saved without --save-detailed (it holds "
            "only summary figures); rerun `vllm bench serve --save-result --save-detailed`"
        )
    if missing:
        raise VllmBenchError(
            f"{where}: missing per-request field(s) {', '.join(missing)}; `vllm bench serve --save-result "
            "--save-detailed` (vLLM 0.32 or newer) writes them all"
        )
    if result.get("ramp_up_strategy") is not None:
        raise VllmBenchError(
            f"{where}: a ramp-up run (ramp_up_strategy {result['ramp_up_strategy']!r}) has no single "
            "load level to file its requests under; import runs at a fixed --request-rate"
        )
    lists = {name: _list(result[name], name=name, where=where) for name in DETAILED_FIELDS}
    if "latencies" in result:
        lists["latencies"] = _list(result["latencies"], name="latencies", where=where)
    lengths = {name: len(values) for name, values in lists.items()}
    n = lengths["ttfts"]
    if len(set(lengths.values())) != 1:
        sizes = ", ".join(f"{name} {size}" for name, size in lengths.items())
        raise VllmBenchError(f"{where}: the per-request lists differ in length ({sizes}): a damaged file")
    if n == 0:
        raise VllmBenchError(f"{where}: the run holds no requests")
    said_completed, said_failed = result.get("completed"), result.get("failed")
    if type(said_completed) is int and type(said_failed) is int and said_completed + said_failed != n:
        raise VllmBenchError(
            f"{where}: the lists hold {n} requests but completed + failed = {said_completed} + "
            f"{said_failed}: a damaged file"
        )
    run_id = _run_id(result)
    starts = [
        finite_number(s, where=f"{where}: request {i} (start_times)")
        for i, s in enumerate(lists["start_times"])
    ]
    first = min(starts)
    requests = tuple(
        _request(lists, i, starts[i] - first, run_id=run_id, context_tokens=context_tokens, where=where)
        for i in range(n)
    )
    completed = sum(r.error is None for r in requests)
    if type(said_completed) is int and completed != said_completed:
        raise VllmBenchError(
            f"{where}: {completed} requests have a first token and no error, but the file says completed "
            f"= {said_completed}: a damaged file"
        )
    return ServeRun(run_id=run_id, request_rate=_request_rate(result, where=where), requests=requests)


def _list(value: object, *, name: str, where: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise VllmBenchError(f"{where}: {name} must be an array, got {type(value).__name__}")
    return value


def _request(
    lists: Mapping[str, Sequence[Any]],
    i: int,
    start_s: float,
    *,
    run_id: str,
    context_tokens: int,
    where: str,
) -> BenchRequest:
    at = f"{where}: request {i}"
    input_len = non_negative_int(lists["input_lens"][i], where=f"{at} (input_lens)")
    output_len = non_negative_int(lists["output_lens"][i], where=f"{at} (output_lens)")
    ttft = finite_number(lists["ttfts"][i], where=f"{at} (ttfts)")
    itls = lists["itls"][i]
    if not isinstance(itls, list):
        raise VllmBenchError(f"{at} (itls): expected an array of inter-token latencies")
    gaps = [finite_number(x, where=f"{at} (itls)") for x in itls]
    error = lists["errors"][i]
    if not isinstance(error, str):
        raise VllmBenchError(f"{at} (errors): expected a string, got {error!r}")
    if "latencies" in lists:
        latency = finite_number(lists["latencies"][i], where=f"{at} (latencies)")
    else:  # files without per-request latencies: the last token's time, as vLLM's timeline plot takes it
        latency = ttft + math.fsum(gaps)
    if input_len < context_tokens:
        raise VllmBenchError(
            f"{at}: input_lens {input_len} is shorter than the declared context of {context_tokens} tokens"
        )
    ok = error == "" and ttft > 0
    return BenchRequest(
        conversation_id=f"{run_id}/{i}",
        turn=2 if context_tokens else 1,
        n_in=input_len - context_tokens,
        n_out=output_len,
        n_ctx=context_tokens,
        ttft_ms=ttft * 1000.0,
        tpot_ms=(latency - ttft) * 1000.0 / (output_len - 1) if output_len > 1 else None,
        e2e_ms=latency * 1000.0,
        error=None if ok else _error_text(error),
        start_s=start_s,
    )


def _error_text(error: str) -> str:
    """The last line of vLLM's error text (a traceback ends with the exception)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return "failed without an error message (vllm bench serve recorded no reason)"
    return lines[-1]


def _request_rate(result: Mapping[str, Any], *, where: str) -> float | None:
    rate = result.get("request_rate")
    if rate == "inf":
        return None
    value = finite_number(rate, where=f"{where} (request_rate)")
    if value <= 0:
        raise VllmBenchError(f"{where}: request_rate must be > 0, got {rate!r}")
    return value


def _run_id(result: Mapping[str, Any]) -> str:
    """vLLM's default result-file name (``compute_result_filename``) from the object's own fields."""
    label = result.get("label") or result.get("backend") or "vllm-bench-serve"
    concurrency = result.get("max_concurrency")
    rate = f"{result.get('request_rate')}qps" + (
        f"-concurrency{concurrency}" if concurrency is not None else ""
    )
    model = str(result.get("model_id") or "").split("/")[-1]
    date = result.get("date")
    return "-".join(str(part) for part in (label, rate, model, date) if part)

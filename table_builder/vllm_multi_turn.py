"""vLLM's multi-turn benchmark (``benchmark_serving_multi_turn.py --stats-json-output FILE``) -> requests
(``docs/vllm-protocol.md`` 6.3-6.4 define the format and the mapping).

Rules:

1. The file is a JSON array with one object per *completed* turn. The benchmark keeps no entry for a
   turn that failed (and sends no later turns of that conversation), so every request read here
   got an answer, and only one whose stream ended without ``[DONE]`` (``latency_ms`` -1) is read as a
   failure. Success rates built from these files overstate the real ones; the import says so
   (``MISSING``).
2. Turn = ceil(``input_num_turns`` / 2): the messages sent alternate user/assistant and end on the
   user's question (a leading system message makes the count even; the same formula holds).
3. Context = the tokens of every message before the question: ``input_num_tokens *
   approx_cached_percent / 100``, rounded; the new input = the rest. On Turn 1 the only possible context
   is a system prompt, which counts as new input (a record's Turn 1 has no context).
4. TTFT and TPOT are the benchmark's own: TTFT to the first non-empty content, corrected for a first
   chunk of several tokens; TPOT over the tokens after the first chunk. A non-streamed turn
   (``--no-stream``: no first chunk) has neither; a TPOT of 0 with no token after the first chunk is
   "not measured", not zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from table_builder.vllm_run import BenchRequest, VllmBenchError, finite_number, non_negative_int

__all__ = ["MISSING", "STATS_FIELDS", "read_multi_turn_stats"]

#: The per-request keys read (``RequestStats`` of the benchmark; ``output_num_chunks`` and
#: ``client_id`` are written too and not needed).
STATS_FIELDS: Final = (
    "ttft_ms",
    "tpot_ms",
    "latency_ms",
    "start_time_ms",
    "input_num_turns",
    "input_num_tokens",
    "output_num_tokens",
    "output_num_first_chunk_tokens",
    "approx_cached_percent",
    "conversation_id",
)

#: What the multi-turn benchmark's output lacks for a complete record set (rule 1), said on import.
MISSING: Final = (
    "failed turns: the multi-turn benchmark writes only turns that got an answer (a rejected or "
    "timed-out turn, and the rest of its conversation, leave no entry), so success rates read from it "
    "overstate the real ones"
)


def read_multi_turn_stats(stats: Sequence[Any], *, where: str) -> tuple[BenchRequest, ...]:
    """The array of ``--stats-json-output`` -> its requests, start times relative to the first."""
    if not stats:
        raise VllmBenchError(f"{where}: the array holds no requests")
    rows = [_row(entry, i, where=where) for i, entry in enumerate(stats)]
    first = min(
        finite_number(row["start_time_ms"], where=f"{where}: request {i} (start_time_ms)")
        for i, row in enumerate(rows)
    )
    return tuple(_request(row, i, first, where=where) for i, row in enumerate(rows))


def _row(entry: object, i: int, *, where: str) -> Mapping[str, Any]:
    if not isinstance(entry, dict):
        raise VllmBenchError(f"{where}: request {i}: expected an object, got {type(entry).__name__}")
    missing = [name for name in STATS_FIELDS if name not in entry]
    if missing:
        raise VllmBenchError(f"{where}: request {i}: missing field(s) {', '.join(missing)}")
    return entry


def _request(row: Mapping[str, Any], i: int, first_ms: float, *, where: str) -> BenchRequest:
    at = f"{where}: request {i}"

    def number(name: str) -> float:
        return finite_number(row[name], where=f"{at} ({name})")

    def count(name: str) -> int:
        return non_negative_int(row[name], where=f"{at} ({name})")

    turns = count("input_num_turns")
    if turns < 1:
        raise VllmBenchError(f"{at} (input_num_turns): a turn sends at least one message, got 0")
    n_input = count("input_num_tokens")
    n_out = count("output_num_tokens")
    first_chunk_tokens = count("output_num_first_chunk_tokens")
    cached = number("approx_cached_percent")
    if not 0.0 <= cached <= 100.0:
        raise VllmBenchError(f"{at} (approx_cached_percent): must lie in [0, 100], got {cached!r}")
    conversation = row["conversation_id"]
    if isinstance(conversation, bool) or not isinstance(conversation, str | int) or conversation == "":
        raise VllmBenchError(f"{at} (conversation_id): expected a non-empty string, got {conversation!r}")
    turn = math.ceil(turns / 2)
    n_ctx = round(n_input * cached / 100.0) if turn > 1 else 0
    ttft, tpot, latency = number("ttft_ms"), number("tpot_ms"), number("latency_ms")
    streamed = first_chunk_tokens > 0
    error = None
    if latency == -1.0:
        error = "the stream ended without [DONE] (the multi-turn benchmark recorded latency -1)"
    return BenchRequest(
        conversation_id=str(conversation),
        turn=turn,
        n_in=n_input - n_ctx,
        n_out=n_out,
        n_ctx=n_ctx,
        # -1 is the benchmark's "no first-token time" sentinel.
        ttft_ms=ttft if streamed and ttft != -1.0 else None,
        tpot_ms=tpot if streamed and n_out > max(1, first_chunk_tokens) else None,
        e2e_ms=latency,
        error=error,
        start_s=(number("start_time_ms") - first_ms) / 1000.0,
    )

"""The multi-turn benchmark's ``--stats-json-output`` -> requests (table_builder/vllm_multi_turn.py)."""

from __future__ import annotations

from typing import Any

import pytest

from table_builder.vllm_multi_turn import read_multi_turn_stats
from table_builder.vllm_run import VllmBenchError
from tests.support.vllm_bench import MULTI_TURN, load


def _stats() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = load(MULTI_TURN)
    return rows


def _entry(**changes: Any) -> dict[str, Any]:
    """One RequestStats entry: Turn 2 (3 messages), 512 tokens of which 256 are history, streamed."""
    row: dict[str, Any] = {
        "ttft_ms": 60.0,
        "tpot_ms": 11.0,
        "latency_ms": 60.0 + 63 * 11.0,
        "start_time_ms": 1000.0,
        "input_num_turns": 3,
        "input_num_tokens": 512,
        "output_num_tokens": 64,
        "output_num_chunks": 63,
        "output_num_first_chunk_tokens": 1,
        "approx_cached_percent": 50.0,
        "conversation_id": "CONV_ID_0",
        "client_id": 0,
    }
    row.update(changes)
    return row


def test_turns_context_and_figures_come_from_the_benchmarks_own_fields() -> None:
    requests = read_multi_turn_stats(_stats(), where="f")
    assert [(r.conversation_id, r.turn, r.n_ctx, r.n_in, r.n_out) for r in requests] == [
        ("CONV_ID_0", 1, 0, 128, 128),
        ("CONV_ID_1", 1, 0, 128, 128),
        ("CONV_ID_0", 2, 256, 256, 64),
        ("CONV_ID_1", 2, 256, 256, 64),
        ("CONV_ID_2", 2, 256, 256, 64),
    ]
    second = requests[2]
    assert (second.ttft_ms, second.tpot_ms) == (61.7, 11.2)
    assert second.e2e_ms == pytest.approx(61.7 + 63 * 11.2)
    assert second.start_s == pytest.approx((5_001_400.0 - 5_000_000.125) / 1000)
    assert requests[0].start_s == 0.0


def test_a_stream_that_ended_without_done_is_a_failure() -> None:
    last = read_multi_turn_stats(_stats(), where="f")[-1]
    assert last.error is not None
    assert "[DONE]" in last.error


@pytest.mark.parametrize(("messages", "turn"), [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (7, 4)])
def test_turn_counts_user_questions_with_or_without_a_system_message(messages: int, turn: int) -> None:
    (got,) = read_multi_turn_stats([_entry(input_num_turns=messages)], where="f")
    assert got.turn == turn


def test_a_system_prompt_on_turn1_is_new_input_not_context() -> None:
    (got,) = read_multi_turn_stats([_entry(input_num_turns=2, approx_cached_percent=25.0)], where="f")
    assert (got.turn, got.n_ctx, got.n_in) == (1, 0, 512)


def test_context_is_rounded_from_the_cached_percent() -> None:
    # 1000 tokens, 333 of them history: the benchmark writes 100 * 333 / 1000
    (got,) = read_multi_turn_stats(
        [_entry(input_num_tokens=1000, approx_cached_percent=100.0 * (333 / 1000))], where="f"
    )
    assert (got.n_ctx, got.n_in) == (333, 667)


def test_a_non_streamed_turn_has_no_ttft_or_tpot() -> None:
    # --no-stream: no first chunk, ttft = latency, tpot 0
    row = _entry(
        ttft_ms=700.0, tpot_ms=0.0, latency_ms=700.0, output_num_chunks=0, output_num_first_chunk_tokens=0
    )
    (got,) = read_multi_turn_stats([row], where="f")
    assert (got.ttft_ms, got.tpot_ms, got.e2e_ms, got.error) == (None, None, 700.0, None)


@pytest.mark.parametrize(("n_out", "first_chunk"), [(1, 1), (5, 5)])
def test_no_token_after_the_first_chunk_means_no_tpot(n_out: int, first_chunk: int) -> None:
    row = _entry(tpot_ms=0.0, output_num_tokens=n_out, output_num_first_chunk_tokens=first_chunk)
    (got,) = read_multi_turn_stats([row], where="f")
    assert got.tpot_ms is None
    assert got.ttft_ms == 60.0


def test_the_no_first_token_sentinel_reads_as_no_ttft() -> None:
    (got,) = read_multi_turn_stats([_entry(ttft_ms=-1.0)], where="f")
    assert got.ttft_ms is None


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ([], r"f: the array holds no requests"),
        (["x"], r"request 0: expected an object, got str"),
        ([{"ttft_ms": 1.0}], r"request 0: missing field\(s\) tpot_ms, latency_ms, "),
        ([_entry(ttft_ms=float("nan"))], r"request 0 \(ttft_ms\): expected a finite number"),
        ([_entry(input_num_tokens=51.2)], r"request 0 \(input_num_tokens\): expected a whole number"),
        ([_entry(input_num_turns=0)], r"request 0 \(input_num_turns\): a turn sends at least one message"),
        ([_entry(approx_cached_percent=120.0)], r"approx_cached_percent\): must lie in \[0, 100\]"),
        ([_entry(conversation_id="")], r"conversation_id\): expected a non-empty string"),
        ([_entry(conversation_id=None)], r"conversation_id\): expected a non-empty string"),
    ],
)
def test_a_damaged_stats_array_is_refused_with_the_reason(entry: list[Any], message: str) -> None:
    with pytest.raises(VllmBenchError, match=message):
        read_multi_turn_stats(entry, where="f")


def test_numeric_conversation_ids_become_labels() -> None:
    (got,) = read_multi_turn_stats([_entry(conversation_id=17)], where="f")
    assert got.conversation_id == "17"

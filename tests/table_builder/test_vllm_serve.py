"""``vllm bench serve --save-result --save-detailed`` result objects -> requests (vllm_serve.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from table_builder.vllm_run import VllmBenchError
from table_builder.vllm_serve import DETAILED_FIELDS, read_serve_result
from tests.support.vllm_bench import SERVE_APPEND, SERVE_PD, SERVE_SUMMARY, load


def _pd() -> dict[str, Any]:
    doc: dict[str, Any] = load(SERVE_PD)
    return doc


def test_each_request_maps_to_one_turn1_request_with_vllms_own_figures() -> None:
    doc = _pd()
    run = read_serve_result(doc, context_tokens=0, where="f")
    assert run.run_id == "vllm-2.0qps-Llama-3.1-8B-Instruct-20261201-153012"  # vLLM's own file name
    assert run.request_rate == 2.0
    assert len(run.requests) == 6
    first = run.requests[0]
    assert (first.turn, first.n_ctx, first.n_in, first.n_out) == (1, 0, 512, 64)
    assert first.conversation_id == f"{run.run_id}/0"
    assert first.ttft_ms == pytest.approx(doc["ttfts"][0] * 1000)
    assert first.e2e_ms == pytest.approx(doc["latencies"][0] * 1000)
    # vLLM's per-request TPOT: (latency - ttft) / (output_len - 1)
    expected = (doc["latencies"][0] - doc["ttfts"][0]) * 1000 / 63
    assert first.tpot_ms == pytest.approx(expected)
    assert first.error is None
    assert first.start_s == 0.0
    assert run.requests[1].start_s == pytest.approx(doc["start_times"][1] - doc["start_times"][0])


def test_means_of_the_requests_are_the_files_own_summary_means() -> None:
    doc = _pd()
    ok = [r for r in read_serve_result(doc, context_tokens=0, where="f").requests if r.error is None]
    ttft = math.fsum(r.ttft_ms or 0.0 for r in ok) / len(ok)
    tpot = math.fsum(r.tpot_ms or 0.0 for r in ok) / len(ok)
    assert ttft == pytest.approx(doc["mean_ttft_ms"])
    assert tpot == pytest.approx(doc["mean_tpot_ms"])


def test_a_failed_request_carries_the_last_line_of_vllms_traceback() -> None:
    failed = read_serve_result(_pd(), context_tokens=0, where="f").requests[3]
    assert failed.error == "aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"
    assert failed.n_out == 0


def test_a_failure_without_a_message_still_fails_with_a_reason() -> None:
    doc = _pd()
    doc["errors"][3] = ""  # an HTTP error without a reason phrase: vLLM records ""
    failed = read_serve_result(doc, context_tokens=0, where="f").requests[3]
    assert failed.error is not None
    assert "no reason" in failed.error


def test_declared_context_makes_each_request_a_turn2_of_that_context() -> None:
    run = read_serve_result(_pd(), context_tokens=256, where="f")
    assert {(r.turn, r.n_ctx, r.n_in) for r in run.requests} == {(2, 256, 256)}


def test_a_prompt_shorter_than_the_declared_context_is_refused() -> None:
    with pytest.raises(VllmBenchError, match=r"request 0: input_lens 512 is shorter than .* 600 tokens"):
        read_serve_result(_pd(), context_tokens=600, where="f")


def test_an_answer_of_one_token_has_no_tpot() -> None:
    first_line = SERVE_APPEND.read_text(encoding="utf-8").splitlines()[0]
    run = read_serve_result(json.loads(first_line), context_tokens=0, where="f")
    assert run.requests[1].n_out == 1
    assert run.requests[1].tpot_ms is None
    assert run.run_id == "openai-chat-4.0qps-Llama-3.1-8B-Instruct-20261201-170001"


def test_without_save_detailed_the_file_is_refused_naming_the_flag() -> None:
    doc = load(SERVE_SUMMARY)
    assert "latencies" in doc  # vLLM keeps these even without --save-detailed: not enough for a record
    with pytest.raises(VllmBenchError, match=r"f: no per-request data: .*--save-result --save-detailed"):
        read_serve_result(doc, context_tokens=0, where="f")


def test_a_partly_detailed_file_names_the_missing_lists() -> None:
    doc = _pd()
    del doc["start_times"], doc["itls"]
    with pytest.raises(
        VllmBenchError, match=r"missing per-request field\(s\) itls, start_times; .*--save-detailed"
    ):
        read_serve_result(doc, context_tokens=0, where="f")


def test_without_per_request_latencies_the_last_token_time_is_used() -> None:
    doc = _pd()
    with_latencies = read_serve_result(doc, context_tokens=0, where="f").requests[0]
    del doc["latencies"]
    without = read_serve_result(doc, context_tokens=0, where="f").requests[0]
    assert without.e2e_ms == pytest.approx(with_latencies.e2e_ms)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["ttfts"].pop(), r"differ in length \(input_lens 6, .*ttfts 5"),
        (lambda d: d.update(completed=6), r"completed \+ failed = 6 \+ 1"),
        (
            lambda d: d.update(completed=4, failed=2),
            r"5 requests have a first token and no error, .*completed = 4",
        ),
        (lambda d: d["ttfts"].__setitem__(2, float("nan")), r"request 2 \(ttfts\): expected a finite number"),
        (lambda d: d["ttfts"].__setitem__(2, "0.1"), r"request 2 \(ttfts\): expected a number, got string"),
        (
            lambda d: d["input_lens"].__setitem__(1, 512.0),
            r"request 1 \(input_lens\): expected a whole number",
        ),
        (lambda d: d["output_lens"].__setitem__(1, -1), r"request 1 \(output_lens\): expected a number >= 0"),
        (lambda d: d["itls"].__setitem__(0, 0.01), r"request 0 \(itls\): expected an array"),
        (lambda d: d["errors"].__setitem__(0, None), r"request 0 \(errors\): expected a string"),
        (lambda d: d.update(ttfts={}), r"ttfts must be an array"),
        (lambda d: d.update(request_rate="fast"), r"\(request_rate\): expected a number, got string"),
        (lambda d: d.update(request_rate=0.0), r"request_rate must be > 0"),
        (lambda d: d.update(ramp_up_strategy="linear"), r"a ramp-up run .* no single load level"),
        (lambda d: d.update(total_input_sequences=6, backend="openai-embeddings"), r"a pooling benchmark"),
        (lambda d: [d[name].clear() for name in (*DETAILED_FIELDS, "latencies")], r"holds no requests"),
    ],
)
def test_a_damaged_or_unusable_result_is_refused_with_the_reason(change: Any, message: str) -> None:
    doc = _pd()
    change(doc)
    with pytest.raises(VllmBenchError, match=message):
        read_serve_result(doc, context_tokens=0, where="f")


def test_an_infinite_request_rate_reads_as_no_rate() -> None:
    doc = _pd()
    doc["request_rate"] = "inf"
    assert read_serve_result(doc, context_tokens=0, where="f").request_rate is None


def test_max_concurrency_is_part_of_the_run_name_as_in_vllms_file_name() -> None:
    doc = _pd()
    doc["max_concurrency"] = 8
    doc["label"] = "pd-run"
    run = read_serve_result(doc, context_tokens=0, where="f")
    assert run.run_id == "pd-run-2.0qps-concurrency8-Llama-3.1-8B-Instruct-20261201-153012"

"""ψ measurement: token counts and their source, expected output, the windowed QPS with hysteresis."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.psi import (
    TEMPLATE_TOKENS_PER_MESSAGE,
    QpsMeter,
    Tokenizers,
    estimate_tokens,
    expected_output,
    message_text,
)
from gateway.sessions import Session


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "model", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "qwen3-8b"]
)
def test_llama_and_qwen_count_exactly(model: str) -> None:
    tok = Tokenizers()
    count = tok.count_messages(model, [{"role": "user", "content": "Hello world"}])
    assert count is not None
    assert count.source == "exact"
    assert count.tokens == 2 + TEMPLATE_TOKENS_PER_MESSAGE


def test_unknown_model_has_no_exact_tokenizer() -> None:
    tok = Tokenizers()
    assert tok.count_messages("acme/secret-model", [{"role": "user", "content": "x"}]) is None
    assert tok.count_text("acme/secret-model", "x") is None


def test_estimate_is_chars_over_four() -> None:
    assert estimate_tokens("x" * 40).tokens == 10
    assert estimate_tokens("").tokens == 0
    assert estimate_tokens("ab").source == "estimate"


def test_message_text_joins_text_parts() -> None:
    parts = [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": "b"},
    ]
    assert message_text({"role": "user", "content": parts}) == "ab"
    assert message_text({"role": "user"}) == ""


HISTORY = Session("s", output_lengths=(100, 300))


@pytest.mark.parametrize(
    ("body", "hint", "session", "expected"),
    [
        ({"max_tokens": 50}, 7, HISTORY, (7, "hint")),
        ({"max_tokens": 50, "ignore_eos": True}, None, HISTORY, (50, "ignore_eos")),
        ({"max_tokens": 500}, None, HISTORY, (200, "history")),
        ({"max_tokens": 50}, None, HISTORY, (50, "history")),
        ({}, None, HISTORY, (200, "history")),
        ({"max_completion_tokens": 30, "max_tokens": 90}, None, None, (30, "limit")),
        ({"max_tokens": 90}, None, None, (90, "limit")),
        ({}, None, None, (256, "default")),
        ({"max_tokens": True}, None, None, (256, "default")),
    ],
)
def test_expected_output(
    body: dict[str, Any], hint: int | None, session: Session | None, expected: tuple[int, str]
) -> None:
    assert expected_output(body, hint=hint, session=session, default=256) == expected


def test_qps_is_a_sliding_window_not_a_lifetime_average() -> None:
    clock = FakeClock()
    meter = QpsMeter(window_s=10, hysteresis=0.0, clock=clock)
    for _ in range(100):  # 10 qps for 10 s
        clock.now += 0.1
        meter.record()
    assert meter.rate() == pytest.approx(10, rel=0.1)
    clock.now += 20  # silence: the window forgets
    assert meter.rate() == 0


def test_qps_hysteresis_ignores_small_moves() -> None:
    clock = FakeClock()
    meter = QpsMeter(window_s=10, hysteresis=0.2, clock=clock)
    for _ in range(100):
        clock.now += 0.1
        meter.record()
    first = meter.rate()
    for _ in range(5):  # 5 % more traffic: inside the band
        clock.now += 0.01
        meter.record()
    assert meter.rate() == first
    for _ in range(100):  # doubling leaves the band
        clock.now += 0.05
        meter.record()
    assert meter.rate() > first * 1.2


def test_qps_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="positive"):
        QpsMeter(window_s=0, hysteresis=0.1, clock=FakeClock())


async def test_measure_assembles_psi_once_worker_count_only_without_an_exact_tokenizer() -> None:
    from gateway.psi import Psi, TokenCount, Tokenizers, measure
    from gateway.sessions import Session

    asked: list[str] = []

    async def worker_count() -> int | None:
        asked.append("tokenize")
        return 17

    session = Session("s").after_turn(
        worker="D0", prompt_tokens=30, completion_tokens=6, history_key="", history_messages=0
    )
    messages = [{"role": "user", "content": "x" * 40}]
    body = {"max_tokens": 50}
    tokenizers = Tokenizers()
    common: dict[str, Any] = {
        "body": body,
        "new_messages": messages,
        "session": session,
        "default_output": 256,
    }
    unknown = await measure(
        tokenizers, model="example/unknown", hint=None, worker_count=worker_count, **common
    )
    assert unknown == Psi(TokenCount(17, "worker"), n_out=6, n_ctx=36)
    estimate = await measure(tokenizers, model="example/unknown", hint=9, **common)
    assert estimate == Psi(TokenCount(10, "estimate"), n_out=9, n_ctx=36)
    exact = await measure(
        tokenizers, model="meta-llama/Llama-3.1-8B-Instruct", hint=None, worker_count=worker_count, **common
    )
    assert exact.n_in.source == "exact"
    assert asked == ["tokenize"]  # an exact tokenizer is never second-guessed by a worker
    prompt = await measure(
        tokenizers,
        model="example/unknown",
        body={"prompt": "y" * 8},
        new_messages=None,
        session=None,
        hint=None,
        default_output=256,
    )
    assert prompt == Psi(TokenCount(2, "estimate"), n_out=256, n_ctx=0)

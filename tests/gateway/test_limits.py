"""The pure request checks: client identifiers, and a request against the model's length (the prompt
counted as a lower bound, and only when a byte bound says it may not fit)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import BadRequestError
from gateway.limits import check_client_id, check_model_length, prompt_token_floor
from gateway.psi import Tokenizers

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class SpyCounter:
    def __init__(self) -> None:
        self.calls = 0
        self.exact = Tokenizers().encoding(MODEL)

    def count(self, text: str) -> int:
        self.calls += 1
        assert self.exact is not None
        return self.exact.count(text)


def _chat(text: str, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    messages = [{"role": "user", "content": text}]
    return {"model": MODEL, "messages": messages, **body}, messages


@pytest.mark.parametrize("value", ["a", "A-z_0.9:@/+=~", "x" * 16])
def test_client_ids_accepted(value: str) -> None:
    assert check_client_id(value, "session_id", max_length=16) == value


@pytest.mark.parametrize("value", ["", "x" * 17, "a b", "a\nb", "\u00e9", "\ud800", 7, None])
def test_client_ids_refused(value: object) -> None:
    with pytest.raises(BadRequestError) as info:
        check_client_id(value, "session_id", max_length=16)
    assert info.value.param == "session_id"


def test_no_count_while_the_byte_bound_fits() -> None:
    spy = SpyCounter()
    body, messages = _chat("word " * 1000, max_tokens=100)  # 5,000 bytes + 4 + 100 < 8,192
    check_model_length(body, messages, max_model_len=8192, counter=spy)
    assert spy.calls == 0
    body, messages = _chat("word " * 2000, max_tokens=100)  # 10,000 bytes: may not fit, so counted
    check_model_length(body, messages, max_model_len=8192, counter=spy)
    assert spy.calls == 1


@pytest.mark.parametrize(
    ("text", "max_tokens", "refused"),
    [
        ("word " * 2000, 6000, False),  # 2,004 + 6,000 <= 8,192
        ("word " * 2000, 6200, True),  # 2,004 + 6,200 > 8,192
        ("word " * 8000, None, False),  # at least 8,004 prompt tokens: room for one more
        ("word " * 8200, None, True),
        ("\u4f60\u597d" * 3000, 2000, False),  # non-ASCII: 18,000 bytes may not fit; 6,004 + 2,000 do
        ("\u4f60\u597d" * 3000, 2300, True),  # 6,004 + 2,300 do not
        (" " * 20_000 + "x", 8000, False),  # trimmed by the template
        ("<|eot_id|>" * 5000, 8000, False),  # special-token markers: the gateway cannot tell
    ],
)
def test_model_length(text: str, max_tokens: int | None, refused: bool) -> None:
    body, messages = _chat(text, **({"max_tokens": max_tokens} if max_tokens else {}))
    counter = Tokenizers().encoding(MODEL)
    if not refused:
        check_model_length(body, messages, max_model_len=8192, counter=counter)
        return
    with pytest.raises(BadRequestError) as info:
        check_model_length(body, messages, max_model_len=8192, counter=counter)
    assert "8192" in info.value.message


def test_unknown_length_or_tokenizer_checks_only_what_it_can() -> None:
    body, messages = _chat("word " * 20_000, max_tokens=10)
    check_model_length(body, messages, max_model_len=None, counter=None)
    check_model_length(body, messages, max_model_len=8192, counter=None)  # no tokenizer: no count
    with pytest.raises(BadRequestError):
        check_model_length({"max_tokens": 9000}, messages, max_model_len=8192, counter=None)
    ids = {"prompt": list(range(8000)), "max_tokens": 500}  # token ids need no tokenizer
    with pytest.raises(BadRequestError):
        check_model_length(ids, [], max_model_len=8192, counter=None)
    assert prompt_token_floor({"prompt": [[1, 2, 3]]}, [], None) == 3
    assert prompt_token_floor({"prompt": "hi <|eot_id|>"}, [], Tokenizers().encoding(MODEL)) is None

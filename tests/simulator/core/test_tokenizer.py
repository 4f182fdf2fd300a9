"""The simulator's tokenizer parses special tokens as quicktok's `encode_with_special` does, in time
linear in the text (quicktok's own call grows with the square of the number of special tokens)."""

from __future__ import annotations

import pytest
import quicktok

from simulator.core.tokenizer import ChatMessage, Llama3Tokenizer


@pytest.fixture(scope="module")
def tok() -> Llama3Tokenizer:
    return Llama3Tokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "<|eot_id|>",
        "a<|eot_id|>b<|begin_of_text|><|reserved_special_token_5|> c  \n\n<|eot_id",
        "<|<|eot_id|>|>",
        "<|start_header_id|>user<|end_header_id|>\n\n  Hello!  <|eot_id|>\n",
        "h\u00e9llo w\u00f6rld \u4f60\u597d \U0001f389<|finetune_right_pad_id|>",
    ],
)
def test_special_tokens_are_parsed_as_quicktok_does(tok: Llama3Tokenizer, text: str) -> None:
    reference = quicktok.get_encoding("llama3").encode_with_special(text)
    assert tok.encode(text, add_special_tokens=False) == reference


@pytest.mark.timeout(60)  # quadratic, this took about 9 minutes here; linear, well under a second
def test_a_3000_message_chat_is_encoded_in_linear_time(tok: Llama3Tokenizer) -> None:
    messages = [ChatMessage("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(3000)]
    ids = tok.encode_chat(messages)
    assert ids.count(tok.eot_id) == 3001  # the system block and every message
    assert ids.count(tok.bos_id) == 1

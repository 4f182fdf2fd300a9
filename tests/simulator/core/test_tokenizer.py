"""The exact Llama-3 tokenizer and the Llama-3.1 chat template: one BOS, the template's text, and special
tokens parsed as quicktok's `encode_with_special` does, in time linear in the text (quicktok's own call
grows with the square of the number of special tokens)."""

from __future__ import annotations

import pytest
import quicktok

from simulator.core.tokenizer import ChatMessage, Llama3Tokenizer, render_chat


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


def test_completion_prompt_gets_one_bos(tok: Llama3Tokenizer) -> None:
    ids = tok.encode("hello world", add_special_tokens=True)
    assert ids == [128000, 15339, 1917]
    assert tok.encode("<|begin_of_text|>hello world", add_special_tokens=True) == ids
    assert tok.encode("hello world", add_special_tokens=False) == [15339, 1917]


def test_chat_template_is_llama31(tok: Llama3Tokenizer) -> None:
    messages = [ChatMessage("system", " Be brief. "), ChatMessage("user", "Hi")]
    text = render_chat(messages)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_id
    assert ids.count(tok.bos_id) == 1
    assert ids.count(tok.eot_id) == 2
    assert ids[-2:] == [128007, 271]  # <|end_header_id|> "\n\n"

"""Token counting for the load generator: the exact Llama-3 BPE from quicktok-v1.

Rule 1: counts are of raw ``content`` strings (no chat template), as vLLM's multi-turn benchmark does.
Rule 2: nothing here downloads anything; the vocabulary ships inside the quicktok wheel.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["LLAMA3_ENCODING", "TokenCounter", "llama3_counter"]

LLAMA3_ENCODING = "llama3"


class TokenCounter(Protocol):
    """Anything that counts the tokens of a text (quicktok's ``Tokenizer`` fits)."""

    def count(self, text: str) -> int: ...


def llama3_counter() -> TokenCounter:
    """The exact Llama-3 tokenizer (Llama-3.1-8B and friends)."""
    import quicktok

    counter: TokenCounter = quicktok.get_encoding(LLAMA3_ENCODING)
    return counter

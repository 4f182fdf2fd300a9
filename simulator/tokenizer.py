"""The exact Llama-3 tokenizer (quicktok's bundled `llama3` encoding) and the Llama-3.1 chat template.

Invariants:
- Rule 1: counts are what vLLM serving Llama-3.1-8B-Instruct would count. A completion prompt gets
  `<|begin_of_text|>` when `add_special_tokens` is true (vLLM's default for `/v1/completions`); a chat
  prompt is rendered with the Llama-3.1 template (which already holds the BOS) and encoded without
  adding another one.
- Rule 2: special-token strings inside the text are parsed as special tokens, as Hugging Face tokenizers
  do for a rendered template.
- Rule 3: encoding is linear in the text. The ordinary runs between special tokens are encoded one by
  one (no token spans a special token, so the ids are those of quicktok's `encode_with_special`, whose
  time grows with the square of the number of special tokens: a 1,000-message chat took over a minute).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import quicktok

__all__ = ["BEGIN_OF_TEXT", "EOT_ID", "ChatMessage", "Llama3Tokenizer", "render_chat"]

BEGIN_OF_TEXT = "<|begin_of_text|>"
EOT_ID = "<|eot_id|>"
_DEFAULT_DATE = "26 Jul 2024"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One text message of a chat request (role and content already validated)."""

    role: str
    content: str


def render_chat(
    messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, date_string: str = _DEFAULT_DATE
) -> str:
    """Render messages with the Llama-3.1-Instruct chat template (no tools)."""
    parts = [BEGIN_OF_TEXT]
    system = ""
    rest = list(messages)
    if rest and rest[0].role == "system":
        system = rest[0].content.strip()
        rest = rest[1:]
    parts.append("<|start_header_id|>system<|end_header_id|>\n\n")
    parts.append("Cutting Knowledge Date: December 2023\n")
    parts.append(f"Today Date: {date_string}\n\n")
    parts.append(system)
    parts.append(EOT_ID)
    for message in rest:
        parts.append(
            f"<|start_header_id|>{message.role}<|end_header_id|>\n\n{message.content.strip()}{EOT_ID}"
        )
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


class Llama3Tokenizer:
    """Encode, decode and render for Llama-3; one instance is shared by every worker of a process."""

    def __init__(self) -> None:
        self._enc = quicktok.get_encoding("llama3")
        self.bos_id: int = self._enc.encode_single_token(BEGIN_OF_TEXT)
        self.eot_id: int = self._enc.encode_single_token(EOT_ID)
        self.vocab_size: int = int(self._enc.n_vocab)
        specials = sorted(self._enc.special_tokens_set, key=len, reverse=True)
        self._special_ids: dict[str, int] = {t: self._enc.encode_single_token(t) for t in specials}
        self._special = re.compile("|".join(re.escape(t) for t in specials))
        self._word_ids, self._first_word_ids = self._find_word_tokens()
        self._text_of: dict[int, str] = {}  # token id -> its text alone (generated tokens are whole words)

    def _find_word_tokens(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Readable, self-delimiting output: " word" tokens, and capitalised "Word" tokens to open a text.

        An answer opens without a space so that the chat template's `trim` leaves it unchanged and the
        next turn's prompt re-tokenizes to exactly the ids generated (the prefix cache then hits them).
        """
        words: list[int] = []
        firsts: list[int] = []
        token_bytes = self._enc.decode_single_token_bytes
        for rank in range(self.bos_id):  # the ordinary (non-special) tokens
            piece: bytes = token_bytes(rank)
            if not 3 <= len(piece) <= 9:
                continue
            if piece[:1] == b" " and len(piece) >= 4 and piece[1:].isalpha() and piece[1:].islower():
                words.append(rank)
            elif len(piece) <= 8 and piece.isalpha() and piece[:1].isupper() and piece[1:].islower():
                firsts.append(rank)
        return tuple(sorted(words)), tuple(sorted(firsts))

    @property
    def word_ids(self) -> tuple[int, ...]:
        """The pool generated text is drawn from."""
        return self._word_ids

    @property
    def first_word_ids(self) -> tuple[int, ...]:
        """The pool the first generated token is drawn from."""
        return self._first_word_ids

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._special.finditer(text):
            if match.start() > start:
                ids += self._enc.encode_ordinary(text[start : match.start()])
            ids.append(self._special_ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._enc.encode_ordinary(text[start:])
        if add_special_tokens and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        rendered = render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(rendered, add_special_tokens=add_special_tokens)

    def is_known(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size

    def is_special(self, token_id: int) -> bool:
        return bool(self._enc.is_special_token(token_id))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and self.is_special(i))]
        text: str = self._enc.decode(kept)
        return text

    def token_text(self, token_id: int) -> str:
        """`decode([token_id])` with special tokens skipped, memoised (the per-token streaming path)."""
        text = self._text_of.get(token_id)
        if text is None:
            text = self.decode([token_id])
            self._text_of[token_id] = text
        return text

    def token_str(self, token_id: int) -> str:
        raw: bytes = self._enc.decode_single_token_bytes(token_id)
        return raw.decode("utf-8", errors="replace")

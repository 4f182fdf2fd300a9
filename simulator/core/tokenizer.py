"""The exact Llama-3 tokenizer (quicktok's bundled `llama3` encoding) and the Llama-3.1 chat template.

Invariants:
- Rule 1: counts are what vLLM serving Llama-3.1-8B-Instruct would count. A completion prompt gets
  `<|begin_of_text|>` when `add_special_tokens` is true (vLLM's default for `/v1/completions`); a chat
  prompt is rendered with the Llama-3.1 template (which already holds the BOS) and encoded without
  adding another one.
- Rule 2: special-token strings inside the text are parsed as special tokens, as Hugging Face tokenizers
  do for a rendered template.
- Rule 3: encoding is linear in the text and comes in pieces of about `SLICE_CHARS` characters, so that a
  caller on an event loop can yield between pieces. The text is cut at special tokens (which the encoding
  never merges across) and, inside a long ordinary run, before a space that follows a printable ASCII
  character: no pre-token of the Llama-3 split pattern spans that point, and matching from it does not
  look behind, so the pieces encode to exactly the ids of the whole text. (quicktok's
  `encode_with_special` is quadratic in the number of special tokens: 1,000 chat messages took ~50 s.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain

import quicktok

__all__ = [
    "BEGIN_OF_TEXT",
    "EOT_ID",
    "SLICE_CHARS",
    "ChatMessage",
    "Llama3Tokenizer",
    "render_chat",
    "render_chat_parts",
]

BEGIN_OF_TEXT = "<|begin_of_text|>"
EOT_ID = "<|eot_id|>"
SLICE_CHARS = 1 << 16  # characters per encoded piece (~1-2 ms of work)
_DEFAULT_DATE = "26 Jul 2024"
_MIN_TOKENS_PER_MESSAGE = 5  # <|start_header_id|> role <|end_header_id|> "\n\n"+content <|eot_id|>


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One text message of a chat request (role and content already validated)."""

    role: str
    content: str


def _ordinary_chunks(text: str, start: int, end: int, size: int) -> Iterator[str]:
    """`text[start:end]` (no special tokens) cut into chunks of at least `size` characters, each cut just
    before a space that follows a printable ASCII character (Rule 3); a run without one stays whole."""
    while end - start > size:
        cut = text.find(" ", start + size, end)
        while cut != -1 and not "!" <= text[cut - 1] <= "~":
            cut = text.find(" ", cut + 1, end)
        if cut == -1:
            break
        yield text[start:cut]
        start = cut
    if start < end:
        yield text[start:end]


def render_chat(
    messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, date_string: str = _DEFAULT_DATE
) -> str:
    """Render messages with the Llama-3.1-Instruct chat template (no tools)."""
    return "".join(
        render_chat_parts(messages, add_generation_prompt=add_generation_prompt, date_string=date_string)
    )


def render_chat_parts(
    messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, date_string: str = _DEFAULT_DATE
) -> Iterator[str]:
    """`render_chat` as consecutive strings: the header (with the system message), then one per message."""
    rest: Sequence[ChatMessage] = messages
    system = ""
    if rest and rest[0].role == "system":
        system = rest[0].content.strip()
        rest = rest[1:]
    yield (
        f"{BEGIN_OF_TEXT}<|start_header_id|>system<|end_header_id|>\n\n"
        f"Cutting Knowledge Date: December 2023\nToday Date: {date_string}\n\n{system}{EOT_ID}"
    )
    for message in rest:
        yield f"<|start_header_id|>{message.role}<|end_header_id|>\n\n{message.content.strip()}{EOT_ID}"
    if add_generation_prompt:
        yield "<|start_header_id|>assistant<|end_header_id|>\n\n"


class Llama3Tokenizer:
    """Encode, decode and render for Llama-3; one instance is shared by every worker of a process."""

    def __init__(self) -> None:
        self._enc = quicktok.get_encoding("llama3")
        self.bos_id: int = self._enc.encode_single_token(BEGIN_OF_TEXT)
        self.eot_id: int = self._enc.encode_single_token(EOT_ID)
        self.vocab_size: int = int(self._enc.n_vocab)
        self._word_ids, self._first_word_ids = self._find_word_tokens()
        self._text_of: dict[int, str] = {}  # token id -> its text alone (generated tokens are whole words)
        specials = sorted(self._enc.special_tokens_set, key=len, reverse=True)
        self._special_id = {text: self._enc.encode_single_token(text) for text in specials}
        self._special_re = re.compile("|".join(map(re.escape, specials)))
        # The smallest rendered chat: an empty system message (the template's fixed header).
        self._chat_floor = len(self.encode_chat([ChatMessage("system", "")], add_generation_prompt=False))

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
        for piece in self.encode_pieces(text, add_special_tokens=add_special_tokens):
            ids += piece
        return ids

    def encode_pieces(
        self, text: str, *, add_special_tokens: bool, slice_chars: int = SLICE_CHARS
    ) -> Iterator[list[int]]:
        """`encode(text)` in consecutive pieces of about `slice_chars` characters each (Rule 3)."""
        need_bos = add_special_tokens
        for ids in self._pieces(text, slice_chars):
            if need_bos:
                need_bos = False
                if ids[0] != self.bos_id:
                    ids.insert(0, self.bos_id)
            yield ids
        if need_bos:
            yield [self.bos_id]

    def _pieces(self, text: str, slice_chars: int) -> Iterator[list[int]]:
        encode = self._enc.encode_ordinary
        ids: list[int] = []
        size = 0  # characters encoded into `ids` so far
        at = 0
        for match in chain(self._special_re.finditer(text), (None,)):  # lazily: no list of all matches
            end = len(text) if match is None else match.start()
            if end - at <= slice_chars:  # the common case: a short run between two special tokens
                if end > at:
                    ids += encode(text[at:end])
                    size += end - at
            else:
                for chunk in _ordinary_chunks(text, at, end, slice_chars):
                    if size >= slice_chars:
                        yield ids
                        ids, size = [], 0
                    ids += encode(chunk)
                    size += len(chunk)
            if match is not None:
                ids.append(self._special_id[match.group()])
                size += match.end() - end
                at = match.end()
            if size >= slice_chars:
                yield ids
                ids, size = [], 0
        if ids:
            yield ids

    def min_chat_tokens(self, n_messages: int) -> int:
        """A lower bound on the tokens of any chat prompt of `n_messages` messages, whatever they hold."""
        return self._chat_floor + _MIN_TOKENS_PER_MESSAGE * max(0, n_messages - 1)

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

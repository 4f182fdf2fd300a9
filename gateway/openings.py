"""What the gateway knows of a Turn 1's prompt before any worker tokenizes it: the marks
(residency.py rule 5) of the prompts it has seen open with the same first message (pure, bounded).

Conversations that share a long system prompt (agents, templates) open with the same first message,
and their prompts then share the leading KV blocks that message renders to. Placing a Turn 1 on the
worker that holds them needs the prompt's block hashes, which only the chat template and the model's
tokenizer give: asking a worker's ``/tokenize`` costs a round trip on every Turn 1. Instead, each
Turn 1 that went through P leaves the marks of its prompt (P's answer carries the prompt's token ids:
plan.py rule 1) under the content key of its first message, and a later Turn 1 opening with the same
message is placed by them.

Rule 1: ``learn(key, marks)``: a first message seen once keeps its prompt's marks; every later prompt
        with that first message keeps only the leading marks both share (equal blocks and hash: the
        same leading blocks), so the entry converges on the prefix the message's conversations have in
        common. An entry that shares nothing any more keeps ``()``.
Rule 2: ``get(key)`` answers an entry's marks (and makes it the most recent), or None for a first
        message not seen: then there is nothing to place by, and the Turn 1 goes to the least loaded
        without a ``/tokenize``. A first message seen once answers its one prompt's marks: the worker
        holding that prompt is the one holding the message's blocks, even if the count overstates them.
Rule 3: at most ``max_entries`` first messages, the least recently used forgotten first; an entry holds
        at most ``residency.MAX_MARKS`` marks, so memory is bounded whatever the prompts.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Marks", "Openings"]

#: residency.py rule 5: (leading blocks, the chain's hash after them), shortest prefix first.
Marks = tuple[tuple[int, int], ...]


class Openings:
    """Rule 1-3: first message's content key -> the marks its prompts share."""

    __slots__ = ("_entries", "_max")

    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self._max = max_entries
        self._entries: OrderedDict[str, Marks] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Marks | None:
        """Rule 2."""
        marks = self._entries.get(key)
        if marks is not None:
            self._entries.move_to_end(key)
        return marks

    def learn(self, key: str, marks: Marks) -> None:
        """Rule 1 (and rule 3's bound)."""
        known = self._entries.get(key)
        if known is None:
            self._entries[key] = marks
            if len(self._entries) > self._max:
                self._entries.popitem(last=False)
            return
        shared = 0
        for mine, theirs in zip(known, marks, strict=False):
            if mine != theirs:
                break
            shared += 1
        self._entries[key] = known[:shared]
        self._entries.move_to_end(key)

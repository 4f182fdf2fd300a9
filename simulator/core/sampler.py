"""Deterministic stand-in for sampling: which real token ids a request generates, and why it stops.

Invariants:
- Rule 1: the output is a pure function of (prompt ids, seed, limits, settings); the same request gives the
  same text on every worker and in every run. Without a `seed` the prompt itself seeds the choice.
- Rule 2: the "model" wants to stop after a natural length drawn from a geometric distribution
  (`mean_natural_tokens`; 0 means it never stops by itself). `min_tokens` suppresses the end-of-turn token
  until that many tokens exist, `ignore_eos` suppresses it entirely, `max_tokens` caps everything.
  A stop ends with `<|eot_id|>`, which counts as a completion token and decodes to no text (vLLM).
- Rule 3: token *i* is computed on demand (a hash of the request key and *i*), so a request asking for
  100,000 tokens costs nothing until they are streamed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ppd.kv_events import BlockHasher, external_hash
from simulator.core.tokenizer import Llama3Tokenizer

__all__ = [
    "UNLIMITED_MEAN_TOKENS",
    "FinishReason",
    "GeneratedBlocks",
    "SampledOutput",
    "SamplerSettings",
    "sample_output",
]

FinishReason = Literal["length", "stop"]
UNLIMITED_MEAN_TOKENS = 256
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplerSettings:
    """How long the simulated model likes to talk."""

    mean_natural_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mean_natural_tokens < 0:
            raise ValueError("mean_natural_tokens must be >= 0")


def _mix(x: int) -> int:
    """splitmix64 finaliser: a fast, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class SampledOutput:
    """`length` generated tokens (the last is `<|eot_id|>` when `finish_reason == "stop"`)."""

    length: int
    finish_reason: FinishReason
    key: int
    words: tuple[int, ...]
    first_words: tuple[int, ...]
    eot_id: int

    def token_at(self, index: int) -> int:
        if self.finish_reason == "stop" and index == self.length - 1:
            return self.eot_id
        pool = self.first_words if index == 0 else self.words
        return pool[_mix(self.key + index) % len(pool)]

    def ids(self, start: int = 0, stop: int | None = None) -> list[int]:
        end = self.length if stop is None else min(stop, self.length)
        return [self.token_at(i) for i in range(start, end)]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self.ids())


def _key(prompt_ids: Sequence[int], seed: int | None) -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"seed" if seed is not None else b"prompt")
    if seed is not None:
        digest.update(seed.to_bytes(8, "little", signed=True))
    else:
        digest.update(len(prompt_ids).to_bytes(8, "little"))
        for token in prompt_ids[-256:]:
            digest.update(token.to_bytes(4, "little"))
    return int.from_bytes(digest.digest(), "little")


def sample_output(
    prompt_ids: Sequence[int],
    *,
    seed: int | None,
    max_tokens: int,
    min_tokens: int,
    ignore_eos: bool,
    settings: SamplerSettings,
    tokenizer: Llama3Tokenizer,
    explicit_limit: bool = True,
) -> SampledOutput:
    """The generated tokens (at most `max_tokens`) and the finish reason.

    `explicit_limit=False` (a chat request without max_tokens) makes a model that never stops by
    itself stop after `UNLIMITED_MEAN_TOKENS` on average instead of filling the context window.
    """
    key = _key(prompt_ids, seed)
    natural: int | None = None
    mean = settings.mean_natural_tokens or (0 if explicit_limit else UNLIMITED_MEAN_TOKENS)
    if not ignore_eos and mean > 0:
        if mean == 1:
            natural = 0
        else:
            u = (_mix(key ^ 0x5EED) + 1) / 2.0**64  # (0, 1]
            natural = int(math.log(u) / math.log(1.0 - 1.0 / mean))
        natural = max(natural, min_tokens)
    if natural is None or natural + 1 > max_tokens:
        length, reason = max_tokens, "length"
    else:
        length, reason = natural + 1, "stop"
    return SampledOutput(
        length=length,
        finish_reason=reason,  # type: ignore[arg-type]
        key=key,
        words=tokenizer.word_ids,
        first_words=tokenizer.first_word_ids,
        eot_id=tokenizer.eot_id,
    )


class GeneratedBlocks:
    """Chained block hashes over prompt + generated output, computed lazily.

    Uses exactly the chaining of :class:`simulator.core.kv_cache.TokenBlocks` (hash((parent, tokens of the
    block))), so a later prompt that contains this output as real tokens hits the same cached blocks.
    With a ``hasher`` (a worker publishing KV events) the chain is vLLM's instead (ppd/kv_events.py:
    the block's id is the 64-bit hash its events carry), and ``block_tokens`` gives the tokens.
    """

    __slots__ = ("_block_size", "_digests", "_hasher", "_hashes", "_output", "_prompt")

    def __init__(
        self,
        prompt_ids: tuple[int, ...],
        output: SampledOutput,
        block_size: int = 16,
        hasher: BlockHasher | None = None,
    ) -> None:
        self._prompt = prompt_ids
        self._output = output
        self._block_size = block_size
        self._hashes: list[int] = []
        self._hasher = hasher
        self._digests: list[bytes] = []

    def _tokens(self, start: int, stop: int) -> tuple[int, ...]:
        n_prompt = len(self._prompt)
        head = self._prompt[start:stop]
        if stop <= n_prompt:
            return head
        return head + tuple(self._output.ids(max(0, start - n_prompt), stop - n_prompt))

    def block_tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """The tokens of blocks ``start`` to ``stop − 1``, concatenated."""
        bs = self._block_size
        return self._tokens(start * bs, stop * bs)

    def block_hash(self, index: int) -> int:
        hashes = self._hashes
        bs = self._block_size
        total = len(self._prompt) + self._output.length
        hasher = self._hasher
        while len(hashes) <= index:
            i = len(hashes)
            if (i + 1) * bs > total:
                return hash(("unknown", id(self), index))
            tokens = self._tokens(i * bs, (i + 1) * bs)
            if hasher is not None:
                digest = hasher.digest(self._digests[i - 1] if i else None, tokens)
                self._digests.append(digest)
                hashes.append(external_hash(digest))
                continue
            parent = hashes[i - 1] if i else 0
            hashes.append(hash((parent, tokens)))
        return hashes[index]

    def block_hashes(self, start: int, stop: int) -> Sequence[int]:
        return [self.block_hash(i) for i in range(start, stop)]

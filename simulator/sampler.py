"""Deterministic stand-in for sampling: which real token ids a request generates, and why it stops.

Invariants:
- Rule 1: the output is a pure function of (prompt ids, seed, limits, settings); the same request gives the
  same text on every worker and in every run. Without a `seed` the prompt itself seeds the choice.
- Rule 2: the "model" wants to stop after a natural length drawn from a geometric distribution
  (`mean_natural_tokens`; 0 means it never stops by itself). `min_tokens` suppresses the end-of-turn token
  until that many tokens exist, `ignore_eos` suppresses it entirely, `max_tokens` caps everything.
  A stop ends with `<|eot_id|>`, which counts as a completion token and decodes to no text (vLLM).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from simulator.tokenizer import Llama3Tokenizer

__all__ = ["UNLIMITED_MEAN_TOKENS", "FinishReason", "SampledOutput", "SamplerSettings", "sample_output"]

UNLIMITED_MEAN_TOKENS = 256

FinishReason = Literal["length", "stop"]


@dataclass(frozen=True, slots=True)
class SamplerSettings:
    """How long the simulated model likes to talk."""

    mean_natural_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mean_natural_tokens < 0:
            raise ValueError("mean_natural_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class SampledOutput:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason


def _rng(prompt_ids: Sequence[int], seed: int | None) -> random.Random:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"seed" if seed is not None else b"prompt")
    if seed is not None:
        digest.update(seed.to_bytes(8, "little", signed=True))
    else:
        digest.update(len(prompt_ids).to_bytes(8, "little"))
        for token in prompt_ids[-256:]:
            digest.update(token.to_bytes(4, "little"))
    return random.Random(int.from_bytes(digest.digest(), "little"))  # noqa: S311 - simulation, not crypto


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
    """The generated token ids (at most `max_tokens`) and the finish reason.

    `explicit_limit=False` (a chat request without max_tokens) makes a model that never stops by
    itself stop after `UNLIMITED_MEAN_TOKENS` on average instead of filling the context window.
    """
    rng = _rng(prompt_ids, seed)
    natural: int | None = None
    mean = settings.mean_natural_tokens or (0 if explicit_limit else UNLIMITED_MEAN_TOKENS)
    if not ignore_eos and mean > 0:
        if mean == 1:
            natural = 0
        else:
            u = 1.0 - rng.random()  # (0, 1]
            natural = int(math.log(u) / math.log(1.0 - 1.0 / mean))
        natural = max(natural, min_tokens)
    if natural is None or natural + 1 > max_tokens:
        return SampledOutput(tuple(_words(rng, tokenizer, max_tokens)), "length")
    words = _words(rng, tokenizer, natural)
    words.append(tokenizer.eot_id)
    return SampledOutput(tuple(words), "stop")


def _words(rng: random.Random, tokenizer: Llama3Tokenizer, n: int) -> list[int]:
    if n <= 0:
        return []
    return [rng.choice(tokenizer.first_word_ids), *rng.choices(tokenizer.word_ids, k=n - 1)]

"""The load generator's workloads: seeded multi-turn conversations with exact token sizes.

Rule 1: pure and deterministic. The same (workload, seed, index) always yields the same conversation,
        byte for byte; randomness comes only from ``random.Random`` seeded with a string.
Rule 2: ``Turn.n_in`` is the exact token count of ``Turn.content`` under the injected counter, and
        ``Turn.n_out`` is the answer length the client asks for (``max_tokens`` with ``ignore_eos``).
Rule 3: synthetic names are ``<turn1>_<class>`` (``catalog.py``, docs/architecture.md "Reference facts");
        Turn 1 uses the Turn-1 setting, every later turn uses the class's (n_in, n_out).
Rule 4: shared-prefix names are ``shared<L>_<G>x<C>_<turn1>_<class>`` (``catalog.SharedPrefixSpec``):
        each conversation is a synthetic ``<turn1>_<class>`` one opened by its group's system prompt
        (``Conversation.prefix``) of exactly ``L`` tokens, drawn from a stream seeded by (name, seed,
        group) alone, so every conversation of a group carries the same prompt, byte for byte. What
        keeps two runs' prompts apart is the load generator's per-run marker (``loadgen.load`` rule 6),
        not this module: the text here is the same in every run of a seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from loadgen.tokens import TokenCounter
from ppd import catalog

__all__ = [
    "MAX_TURNS",
    "SYNTHETIC_WORKLOADS",
    "Conversation",
    "ConversationPool",
    "SharedPrefix",
    "SharedPrefixWorkload",
    "SyntheticWorkload",
    "Turn",
    "Workload",
    "WorkloadError",
    "parse_synthetic_name",
    "single_token_words",
]

MAX_TURNS: Final = 16

#: The paper's 18 synthetic workload names, Turn-1 setting major (one definition: ``catalog.py``).
SYNTHETIC_WORKLOADS: Final[tuple[str, ...]] = tuple(w.name for w in catalog.WORKLOADS)

# Common English words; ``single_token_words`` keeps those that are one token both with and without a
# leading space, so a text of n such words separated by spaces is exactly n tokens.
_WORD_TEXT: Final = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part over new sound take only little work know place year "
    "live me back give most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show also around "
    "form three small set put end does another well large must big even such because turn here why ask "
    "went men read need land different home us move try kind hand picture again change off play spell "
    "air away animal house point page letter mother answer found study still learn should world high"
)
_WORDS: Final = tuple(_WORD_TEXT.split())


_SHAREGPT: Final = "sharegpt"


class WorkloadError(ValueError):
    """An unknown workload name or an impossible size; the message lists what is valid."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn: its text, its exact token count, and the answer length to ask for."""

    content: str
    n_in: int
    n_out: int


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A system prompt that several conversations open with: ``id`` names the group (the same for all
    of them), ``n_tokens`` is the exact token count of ``content``."""

    id: str
    content: str
    n_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]
    #: Sent as the system message before Turn 1; None for conversations that open with the user.
    prefix: SharedPrefix | None = None


class Workload(Protocol):
    """A numbered, endless supply of conversations (index 0, 1, 2, ... in arrival order)."""

    @property
    def name(self) -> str: ...

    def conversation(self, index: int) -> Conversation: ...


def single_token_words(counter: TokenCounter) -> tuple[str, ...]:
    """The built-in words that are exactly one token with and without a leading space."""
    words = tuple(w for w in _WORDS if counter.count(w) == 1 and counter.count(" " + w) == 1)
    if len(words) < 16:
        raise WorkloadError(f"the tokenizer keeps only {len(words)} single-token words; need 16")
    return words


def parse_synthetic_name(name: str) -> tuple[str, str]:
    """``large_mid_paste`` -> ("large", "mid_paste"); raises WorkloadError listing the valid names."""
    try:
        workload = catalog.parse_workload(name)
    except ValueError as exc:
        raise WorkloadError(
            f"{exc}, or '{_SHAREGPT}', or a shared-prefix shared<L>_<G>x<C>_<turn1>_<class>"
        ) from None
    return workload.turn1, workload.turn2


def _words(rng: random.Random, words: tuple[str, ...], n: int) -> str:
    """``n`` single-token words joined by spaces: exactly ``n`` tokens."""
    return " ".join(rng.choices(words, k=n))


def _check_turns(turns: int) -> None:
    if not 1 <= turns <= MAX_TURNS:
        raise WorkloadError(f"turns must be in 1..{MAX_TURNS}, got {turns}")


@dataclass(frozen=True, slots=True)
class SyntheticWorkload:
    """One of the paper's 18 two-turn workloads, optionally stretched to more turns.

    Each conversation's text is drawn from its own seeded stream, so conversations never share a
    prefix (a content-addressed session store sees them as distinct) and a rerun is identical.
    """

    name: str
    words: tuple[str, ...]
    seed: int = 0
    turns: int = 2

    def __post_init__(self) -> None:
        parse_synthetic_name(self.name)
        _check_turns(self.turns)
        if not self.words:
            raise WorkloadError("a synthetic workload needs a non-empty word list")

    def conversation(self, index: int) -> Conversation:
        workload = catalog.parse_workload(self.name)
        rng = random.Random(f"{self.name}:{self.seed}:{index}")  # noqa: S311 - reproducible, not secret
        sizes = [workload.first] + [workload.second] * (self.turns - 1)
        turns = tuple(
            Turn(content=_words(rng, self.words, size.n_in), n_in=size.n_in, n_out=size.n_out)
            for size in sizes
        )
        return Conversation(id=f"{self.name}-s{self.seed}-{index}", turns=turns)


@dataclass(frozen=True, slots=True)
class SharedPrefixWorkload:
    """Synthetic conversations in groups that open with one shared system prompt each (rule 4).

    Conversation ``index`` belongs to group ``spec.group_of(index)`` (round-robin, a fresh set of
    prompts after ``G·C`` conversations); its prompt is drawn from the stream of (name, seed, group),
    its own turns from the stream of (name, seed, index), as ``SyntheticWorkload`` draws them.
    """

    name: str
    words: tuple[str, ...]
    seed: int = 0
    turns: int = 2
    spec: catalog.SharedPrefixSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            spec = catalog.parse_shared_prefix(self.name)
        except ValueError as exc:
            raise WorkloadError(str(exc)) from None
        _check_turns(self.turns)
        if not self.words:
            raise WorkloadError("a shared-prefix workload needs a non-empty word list")
        object.__setattr__(self, "spec", spec)

    def prefix(self, group: int) -> SharedPrefix:
        """The system prompt of ``group`` (the same for every conversation of the group)."""
        rng = random.Random(f"{self.name}:{self.seed}:prefix:{group}")  # noqa: S311 - reproducible
        n = self.spec.prefix_tokens
        return SharedPrefix(
            id=f"{self.name}-s{self.seed}-g{group}", content=_words(rng, self.words, n), n_tokens=n
        )

    def conversation(self, index: int) -> Conversation:
        shape = self.spec.workload
        rng = random.Random(f"{self.name}:{self.seed}:{index}")  # noqa: S311 - reproducible, not secret
        sizes = [shape.first] + [shape.second] * (self.turns - 1)
        turns = tuple(
            Turn(content=_words(rng, self.words, size.n_in), n_in=size.n_in, n_out=size.n_out)
            for size in sizes
        )
        return Conversation(
            id=f"{self.name}-s{self.seed}-{index}",
            turns=turns,
            prefix=self.prefix(self.spec.group_of(index)),
        )


@dataclass(frozen=True, slots=True)
class ConversationPool:
    """A fixed list of conversations served in a seeded order, cycling when it runs out.

    A conversation served a second time gets the suffix ``~<lap>`` so its id stays unique in records.
    """

    name: str
    conversations: Sequence[Conversation]
    seed: int = 0
    turns: int | None = None
    _order: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.conversations:
            raise WorkloadError(f"workload {self.name!r} has no conversations")
        if self.turns is not None:
            _check_turns(self.turns)
        order = list(range(len(self.conversations)))
        random.Random(f"{self.name}:{self.seed}").shuffle(order)  # noqa: S311 - reproducible order
        object.__setattr__(self, "_order", tuple(order))

    def conversation(self, index: int) -> Conversation:
        size = len(self.conversations)
        lap, slot = divmod(index, size)
        chosen = self.conversations[self._order[slot]]
        turns = chosen.turns if self.turns is None else chosen.turns[: self.turns]
        conv_id = chosen.id if lap == 0 else f"{chosen.id}~{lap}"
        return Conversation(id=conv_id, turns=turns, prefix=chosen.prefix)

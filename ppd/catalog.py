"""The paper's synthetic two-turn workloads (``docs/architecture.md``, "Reference facts").

A workload is named ``<turn1>_<class>``: Turn 1 is ``small`` (128 in / 128 out) or ``large``
(1024 / 1024), Turn 2 is one of nine classes with a fixed (n_in, n_out). So the context a Turn-2 request
sees is n_ctx = Turn-1 input + Turn-1 output (256 or 2048 tokens), and the cell a workload measures is
fixed by its name. Nothing here is a routing threshold: those live in the table header.

Our extension: Turn 1 ``huge`` (4096 / 1024, so Turn 2 sees 5120 tokens of context) measures the
context class above 4096 tokens, where the paper's prototype has no data. ``WORKLOADS`` stays the
paper's 18; ``HUGE_WORKLOADS`` are the nine ``huge_*`` ones.

One definition for the whole tree: the table builder (sweeps, artifact pairing), the load generator,
the simulator's synthetic conversations and the decision service's default axes (``paper_axes``) all
read the Turn-1 settings and the nine classes from here. Like all of ``ppd``, it imports none of our
packages.

Our second extension, the shared-prefix family (``SharedPrefixSpec``): agents and RAG templates send
many conversations that open with the same long system prompt. A name
``shared<L>_<G>x<C>_<turn1>_<class>`` (``shared2048_4x8_small_mid_bal``) says: ``G`` groups of ``C``
conversations, every conversation of a group opening with the group's system prompt of ``L`` tokens;
then an ordinary ``<turn1>_<class>`` conversation (Turn 1's new tokens after the prompt, later turns
the class's). Conversations arrive round-robin over the groups (``group_of``); after ``G·C`` of them a
fresh set of ``G`` prompts starts, so no prompt is ever shared by more than ``C`` conversations and
the supply never ends. ``named_class`` gives the Turn-2 class a benchmark name measures, for both
families (the table builder files a benchmark turn under it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "HUGE_WORKLOADS",
    "SHARED_PREFIX_MAX_TOKENS",
    "SHARED_PREFIX_MIN_TOKENS",
    "TURN1_SETTINGS",
    "TURN2_CLASSES",
    "WORKLOADS",
    "SharedPrefixSpec",
    "TokenShape",
    "Workload",
    "is_shared_prefix",
    "named_class",
    "parse_shared_prefix",
    "parse_workload",
    "select_workloads",
]


@dataclass(frozen=True, slots=True)
class TokenShape:
    """New input tokens and output tokens of one turn."""

    n_in: int
    n_out: int


TURN1_SETTINGS: Final[dict[str, TokenShape]] = {
    "small": TokenShape(128, 128),
    "large": TokenShape(1024, 1024),
    "huge": TokenShape(4096, 1024),
}
_PAPER_TURN1: Final = ("small", "large")

# The nine Turn-2 classes of the paper's artifact, in the order of its grid (the default axes the
# tables are built on, ``decision_service.axes.paper_axes``, take them from here).
TURN2_CLASSES: Final[dict[str, TokenShape]] = {
    "tiny": TokenShape(16, 32),
    "short_gen": TokenShape(32, 256),
    "long_gen": TokenShape(32, 512),
    "very_long_gen": TokenShape(64, 1024),
    "small_bal": TokenShape(64, 64),
    "mid_bal": TokenShape(128, 128),
    "mid_paste": TokenShape(256, 64),
    "big_paste": TokenShape(512, 64),
    "huge_paste": TokenShape(1024, 32),
}


@dataclass(frozen=True, slots=True)
class Workload:
    """One synthetic two-turn workload."""

    turn1: str
    turn2: str

    @property
    def name(self) -> str:
        return f"{self.turn1}_{self.turn2}"

    @property
    def first(self) -> TokenShape:
        return TURN1_SETTINGS[self.turn1]

    @property
    def second(self) -> TokenShape:
        return TURN2_CLASSES[self.turn2]

    @property
    def turn2_context(self) -> int:
        """Tokens in the conversation before Turn 2 (the Turn-1 prompt and answer)."""
        return self.first.n_in + self.first.n_out


#: The paper's 18 workloads in a fixed order (Turn-1 setting, then class as listed above).
WORKLOADS: Final[tuple[Workload, ...]] = tuple(
    Workload(turn1, turn2) for turn1 in _PAPER_TURN1 for turn2 in TURN2_CLASSES
)
#: The nine workloads with a ``huge`` Turn 1 (context above 4096 tokens at Turn 2).
HUGE_WORKLOADS: Final[tuple[Workload, ...]] = tuple(Workload("huge", turn2) for turn2 in TURN2_CLASSES)


def parse_workload(name: str) -> Workload:
    """``"large_mid_paste"`` -> ``Workload("large", "mid_paste")``; ``ValueError`` for anything else."""
    turn1, sep, turn2 = name.partition("_")
    if not sep or turn1 not in TURN1_SETTINGS or turn2 not in TURN2_CLASSES:
        raise ValueError(
            f"unknown synthetic workload {name!r}: expected <turn1>_<class> with turn1 in "
            f"{'|'.join(TURN1_SETTINGS)} and class in {'|'.join(TURN2_CLASSES)}"
        )
    return Workload(turn1, turn2)


def select_workloads(text: str) -> tuple[Workload, ...]:
    """A comma list of names and groups (``all``: the paper's 18, ``huge``: the nine huge-context
    ones) -> workloads in the order given, without repeats; ``ValueError`` for an unknown name."""
    chosen: dict[Workload, None] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        group = {"all": WORKLOADS, "huge": HUGE_WORKLOADS}.get(item)
        for w in group if group is not None else (parse_workload(item),):
            chosen[w] = None
    return tuple(chosen)


#: Bounds of a shared system prompt, in tokens: at least one 16-token KV block, at most 8k (the
#: family is meant for 1k-4k prompts; the bounds only refuse what no cluster run would measure).
SHARED_PREFIX_MIN_TOKENS: Final = 16
SHARED_PREFIX_MAX_TOKENS: Final = 8192
#: Bounds of the group count and of the conversations per group.
_MAX_GROUPS: Final = 10_000
_SHARED_PREFIX_FORM: Final = "shared<L>_<G>x<C>_<turn1>_<class>"
_SHARED_PREFIX: Final = re.compile(r"shared(\d+)_(\d+)x(\d+)_(.+)")


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """A shared-prefix workload: ``groups`` system prompts of ``prefix_tokens`` tokens, each opening
    ``per_group`` conversations shaped like the synthetic workload ``<turn1>_<turn2>``."""

    prefix_tokens: int
    groups: int
    per_group: int
    turn1: str
    turn2: str

    def __post_init__(self) -> None:
        if not SHARED_PREFIX_MIN_TOKENS <= self.prefix_tokens <= SHARED_PREFIX_MAX_TOKENS:
            raise ValueError(
                f"shared prefix of {self.prefix_tokens} tokens: it must be "
                f"{SHARED_PREFIX_MIN_TOKENS}..{SHARED_PREFIX_MAX_TOKENS} tokens ({_SHARED_PREFIX_FORM})"
            )
        for what, value in (("groups", self.groups), ("conversations per group", self.per_group)):
            if not 1 <= value <= _MAX_GROUPS:
                raise ValueError(f"{what} must be 1..{_MAX_GROUPS}, got {value} ({_SHARED_PREFIX_FORM})")
        parse_workload(f"{self.turn1}_{self.turn2}")

    @property
    def name(self) -> str:
        return f"shared{self.prefix_tokens}_{self.groups}x{self.per_group}_{self.turn1}_{self.turn2}"

    @property
    def workload(self) -> Workload:
        """The synthetic workload each conversation follows after the shared prompt."""
        return Workload(self.turn1, self.turn2)

    def group_of(self, index: int) -> int:
        """The prompt group of conversation ``index`` (0, 1, 2, ... in arrival order): round-robin over
        ``groups`` prompts, a fresh set of prompts after every ``groups · per_group`` conversations."""
        if index < 0:
            raise ValueError(f"conversation index must be >= 0, got {index}")
        round_, slot = divmod(index, self.groups * self.per_group)
        return round_ * self.groups + slot % self.groups


def is_shared_prefix(name: str) -> bool:
    """Whether ``name`` is meant as a shared-prefix workload (it may still be malformed)."""
    return name.startswith("shared")


def parse_shared_prefix(name: str) -> SharedPrefixSpec:
    """``"shared2048_4x8_small_mid_bal"`` -> its spec; ``ValueError`` saying what is wrong otherwise."""
    match = _SHARED_PREFIX.fullmatch(name)
    if match is None:
        raise ValueError(
            f"bad shared-prefix workload {name!r}: expected {_SHARED_PREFIX_FORM}, e.g. "
            "shared2048_4x8_small_mid_bal (2048-token prompt, 4 groups of 8 conversations)"
        )
    length, groups, per_group, rest = match.groups()
    try:
        shape = parse_workload(rest)
    except ValueError as exc:
        raise ValueError(f"bad shared-prefix workload {name!r}: {exc}") from None
    return SharedPrefixSpec(int(length), int(groups), int(per_group), shape.turn1, shape.turn2)


def named_class(name: str) -> str | None:
    """The Turn-2 class a benchmark workload name measures (synthetic or shared-prefix), else None."""
    try:
        if is_shared_prefix(name):
            return parse_shared_prefix(name).turn2
        return parse_workload(name).turn2
    except ValueError:
        return None

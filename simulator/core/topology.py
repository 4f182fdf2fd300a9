"""Cluster topologies such as `1P3D`, `2P2D`, `3P1D` and `4R` (pure parsing).

A topology is a sequence of `<count><letter>` groups: P = prefill, D = decode, R = replica (a plain
worker serving whole requests). Worker ids are the letter and a 0-based index per role: P0, D0, D1, ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["ROLE_LETTERS", "Role", "Topology", "TopologyError", "WorkerSpec"]

Role = Literal["prefill", "decode", "replica"]
ROLE_LETTERS: dict[str, Role] = {"P": "prefill", "D": "decode", "R": "replica"}
_GROUP = re.compile(r"(\d+)([PDR])")
_MAX_WORKERS = 64


class TopologyError(ValueError):
    """The topology string is not a sequence of `<count><P|D|R>` groups."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    id: str
    role: Role


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    workers: tuple[WorkerSpec, ...]

    @classmethod
    def parse(cls, text: str) -> Topology:
        name = text.strip().upper()
        if not name or _GROUP.sub("", name):
            raise TopologyError(f"bad topology {text!r}: expected groups like 1P3D, 2P2D or 4R")
        counts = dict.fromkeys(ROLE_LETTERS, 0)
        for count, letter in _GROUP.findall(name):
            counts[letter] += int(count)
        total = sum(counts.values())
        if total == 0 or total > _MAX_WORKERS:
            raise TopologyError(f"bad topology {text!r}: between 1 and {_MAX_WORKERS} workers")
        if (counts["P"] == 0) != (counts["D"] == 0):
            raise TopologyError(f"bad topology {text!r}: prefill workers need decode workers and vice versa")
        workers = tuple(
            WorkerSpec(id=f"{letter}{i}", role=ROLE_LETTERS[letter])
            for letter in ROLE_LETTERS
            for i in range(counts[letter])
        )
        return cls(name=name, workers=workers)

    def count(self, role: Role) -> int:
        return sum(1 for w in self.workers if w.role == role)

    @property
    def prefill(self) -> int:
        return self.count("prefill")

    @property
    def decode(self) -> int:
        return self.count("decode")

    @property
    def replica(self) -> int:
        return self.count("replica")

    @property
    def label(self) -> str:
        """The canonical name: groups in P, D, R order, empty groups left out (``3d1p`` -> ``1P3D``)."""
        return "".join(f"{n}{letter}" for letter, role in ROLE_LETTERS.items() if (n := self.count(role)))

"""The `[[workers]]` tables of a gateway TOML config, as the tests that start a gateway on a cluster
write them (one place, so a change to the worker table's keys is made once), and the picker's
observation share pinned for tests that do not test it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["unobserved", "worker_tables"]


def worker_tables(workers: Iterable[Mapping[str, Any]]) -> list[str]:
    """TOML lines: one `[[workers]]` table (id, role, url) per worker, each preceded by a blank line."""
    lines: list[str] = []
    for w in workers:
        lines += ["", "[[workers]]", f'id = "{w["id"]}"', f'role = "{w["role"]}"', f'url = "{w["url"]}"']
    return lines


def unobserved(lines: list[str]) -> list[str]:
    """`lines` with `[log] picker_observe_share = 0` added unless they have a `[log]` table: the picker
    observes a random 5% of answers by default, and an observed turn is remembered with its answer
    (an edited answer then starts a new session), so a test that does not test observation pins it
    off and takes the same path every run."""
    if any(line.strip() == "[log]" for line in lines):
        return lines
    return [*lines, "", "[log]", "picker_observe_share = 0.0"]

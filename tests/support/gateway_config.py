"""The `[[workers]]` tables of a gateway TOML config, as the tests that start a gateway on a cluster
write them (one place, so a change to the worker table's keys is made once)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["worker_tables"]


def worker_tables(workers: Iterable[Mapping[str, Any]]) -> list[str]:
    """TOML lines: one `[[workers]]` table (id, role, url) per worker, each preceded by a blank line."""
    lines: list[str] = []
    for w in workers:
        lines += ["", "[[workers]]", f'id = "{w["id"]}"', f'role = "{w["role"]}"', f'url = "{w["url"]}"']
    return lines

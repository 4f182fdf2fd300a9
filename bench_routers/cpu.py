"""CPU seconds of a process and its descendants, read from /proc (Linux).

Rule 1: a process's utime + stime counts all of its threads; its cutime + cstime counts the children it
        has already waited for. Live descendants are found through /proc/<pid>/task/<tid>/children
        and added the same way, so a router that forks helpers is charged for them too.
Rule 2: a process that is gone (or goes while it is read) counts 0: the figure is a difference of two
        reads around a batch, and a vanished process cannot be read after it either.
Rule 3: a router of several processes that are not one tree (Envoy and the picker, each started on its
        own) is read as one tree per process, by role (`processes_cpu_seconds`); its CPU is the sum.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["processes_cpu_seconds", "tree_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _own_and_reaped(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) may hold spaces and parentheses; the fields after the last ")" do not.
    fields = text.rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3 of proc(5)): utime, stime, cutime, cstime are fields 14-17.
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICKS


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (and the children they reaped)."""
    total = 0.0
    pending = [pid]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        total += _own_and_reaped(current)
        pending += _children(current)
    return total


def processes_cpu_seconds(pids: Mapping[str, int]) -> dict[str, float]:
    """Rule 3: each process's tree CPU seconds, by its role."""
    return {role: tree_cpu_seconds(pid) for role, pid in pids.items()}

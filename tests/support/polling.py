"""Waiting for a condition in tests: poll until it holds, fail naming it after a generous deadline.

The one place for it (a deadline, never a sleep used as synchronisation): ``wait_until`` for plain
predicates, ``eventually`` for coroutine checks on the test's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

__all__ = ["eventually", "wait_until"]


def wait_until(
    predicate: Callable[[], object], *, deadline_s: float, what: str, poll_s: float = 0.05
) -> None:
    """Poll `predicate()` until it is true; fail naming `what` once the deadline passes."""
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(poll_s)


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 20.0, what: str = "condition"
) -> None:
    """Await `check()` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s} s")
        await asyncio.sleep(0.02)

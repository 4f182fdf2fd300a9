"""One long-running asyncio task owned by an object (the KV fabric's timer, a real-time driver's loop).

Rule: ``start`` is idempotent; ``stop`` cancels the task, waits until it has unwound, and leaves the
owner restartable. A task that ended with an error is not hidden: ``stop`` re-raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["BackgroundTask"]


class BackgroundTask:
    __slots__ = ("_factory", "_name", "_task")

    def __init__(self, factory: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._factory = factory
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._factory(), name=self._name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

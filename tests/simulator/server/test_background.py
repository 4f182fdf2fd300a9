"""The owned background task of the KV fabric and the real-time drivers: start once, stop cleanly."""

from __future__ import annotations

import asyncio

import pytest

from simulator.server.background import BackgroundTask


async def test_start_is_idempotent_and_stop_cancels_and_allows_a_restart() -> None:
    started = 0
    cancelled = 0

    async def forever() -> None:
        nonlocal started, cancelled
        started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled += 1
            raise

    task = BackgroundTask(forever, "t")
    task.start()
    task.start()
    await asyncio.sleep(0)
    assert started == 1
    await task.stop()
    assert cancelled == 1
    await task.stop()  # stopping a stopped task is a no-op
    task.start()
    await asyncio.sleep(0)
    assert started == 2
    await task.stop()


async def test_stop_reraises_an_error_the_task_ended_with() -> None:
    async def broken() -> None:
        raise RuntimeError("link model bug")

    task = BackgroundTask(broken, "t")
    task.start()
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="link model bug"):
        await task.stop()

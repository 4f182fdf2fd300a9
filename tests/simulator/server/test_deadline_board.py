"""Drivers sharing one event loop: a delivery pass gives way, between slices, to another due deadline.

No timing is measured: the driver runs on a fixed fake clock and the tests look at the order in which
the pass's writes and another task's loop turns happen.
"""

from __future__ import annotations

import asyncio

import pytest

from simulator.core.engine import Engine, EngineConfig, StepResult
from simulator.core.profile import load_profile
from simulator.server.deadline_board import DeadlineBoard
from simulator.server.jobs import Emission, JobHandle
from simulator.server.realtime import SLICE_TOKENS, RealtimeDriver


def test_board_reports_only_other_drivers_deadlines() -> None:
    board = DeadlineBoard()
    a, b = object(), object()
    assert not board.due(a, 1e9)
    board.post(a, 5.0)
    assert not board.due(a, 10.0)  # its own deadline never counts
    assert board.due(b, 5.0)
    assert not board.due(b, 4.999)
    board.post(b, 3.0)
    assert board.due(a, 3.0)
    board.clear(b)
    assert not board.due(a, 4.0)
    assert board.due(b, 5.0)
    board.clear(a)
    board.clear(a)  # clearing twice is harmless
    assert board.waiting == 0
    assert not board.due(b, 1e9)


def _driver_with_streams(
    board: DeadlineBoard, n: int, events: list[str]
) -> tuple[RealtimeDriver, StepResult]:
    driver = RealtimeDriver(Engine(load_profile(), EngineConfig()), clock=lambda: 100.0, board=board)
    ids = tuple(f"r{i}" for i in range(n))
    for rid in ids:

        def sink(emission: Emission, rid: str = rid) -> bool:
            assert emission.tokens == 1
            assert not emission.finished
            events.append(rid)
            return True

        handle = JobHandle(request_id=rid, submitted_at=0.0, sink=sink)
        driver._handles[rid] = handle
    return driver, StepResult(start=99.0, duration=1.0, sampled=ids)


async def _deliver_beside_a_spinner(board: DeadlineBoard, n: int) -> list[str]:
    """Run one delivery pass of `n` streams while another task takes a loop turn whenever it can."""
    events: list[str] = []
    driver, result = _driver_with_streams(board, n, events)
    stop = False

    async def spinner() -> None:
        while not stop:
            events.append("turn")
            await asyncio.sleep(0)

    task = asyncio.create_task(spinner())
    await asyncio.sleep(0)  # the spinner is now waiting for its next turn
    events.clear()
    await driver._deliver(result)
    stop = True
    await task
    return events


async def test_pass_yields_between_slices_when_another_deadline_is_due() -> None:
    board = DeadlineBoard()
    board.post(object(), 99.5)  # another driver waits for a deadline that has passed (clock: 100)
    n = 4 * SLICE_TOKENS
    events = await _deliver_beside_a_spinner(board, n)
    writes = [e for e in events if e != "turn"]
    assert writes == [f"r{i}" for i in range(n)]  # every token, in order
    first, last = events.index("r0"), events.index(f"r{n - 1}")
    runs = "".join("t" if e == "turn" else "w" for e in events[first : last + 1]).split("t")
    runs = [r for r in runs if r]
    assert len(runs) >= n // SLICE_TOKENS  # the loop got a turn after each slice
    assert max(len(r) for r in runs) <= SLICE_TOKENS


async def test_pass_is_one_piece_when_no_other_deadline_is_due() -> None:
    board = DeadlineBoard()
    board.post(object(), 200.0)  # far in the future
    n = 4 * SLICE_TOKENS
    events = await _deliver_beside_a_spinner(board, n)
    first, last = events.index("r0"), events.index(f"r{n - 1}")
    assert "turn" not in events[first : last + 1]


async def test_a_stopped_driver_leaves_no_deadline_behind() -> None:
    board = DeadlineBoard()
    driver = RealtimeDriver(Engine(load_profile(), EngineConfig()), board=board)
    waiting = asyncio.create_task(driver._sleep_until(driver.now() + 3600.0))
    for _ in range(100):
        if board.waiting:
            break
        await asyncio.sleep(0)
    assert board.waiting == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert board.waiting == 0

"""A served table file changed in place (truncated, overwritten) by a file-system neighbour.

The server must neither crash (a memory-mapped file that shrinks faults with SIGBUS on the next read)
nor let two RPCs disagree: the loaded table keeps serving, byte for byte, whatever happens to its file.
Run against a real `serve` process, so that a crash fails this test instead of killing the runner.
"""

from __future__ import annotations

import asyncio
import os
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from decision_service.table import FIGURES, Table
from ppd.decision.v1 import decision_pb2 as pb
from ppd.decision.v1 import decision_pb2_grpc as pb_grpc
from tests.decision_service.harness import turn2
from tests.decision_service.process import ServeProcess, serve_process
from tests.decision_service.tables import table_bytes, write_table_file
from tests.support.metrics import sample
from tests.support.polling import eventually

pytestmark = pytest.mark.integration


def rejected_as(served: ServeProcess, reason: str) -> Callable[[], Awaitable[bool]]:
    def scrape() -> str:
        with urllib.request.urlopen(served.metrics_url, timeout=10) as response:
            return str(response.read().decode())

    async def check() -> bool:
        text = await asyncio.to_thread(scrape)
        return sample(text, "ppd_table_reloads_total", result=reason) == 1

    return check


def _figures(described: pb.DescribeTableResponse) -> np.ndarray:
    return np.array([[getattr(cell, name) for name in FIGURES] for cell in described.cells])


def _rewrite_in_place(path: Path, blob: bytes) -> None:
    with open(path, "r+b") as fh:  # same inode: what `cp` over a served file does
        fh.write(blob)


async def _assert_serves(stub: pb_grpc.DecisionServiceAsyncStub, expected: Table) -> None:
    """DescribeTable shows `expected`'s figures and Route agrees with it on the cell it answers."""
    described = await stub.DescribeTable(pb.DescribeTableRequest())
    answer = await stub.Route(turn2())
    assert described.table_version == answer.table_version == expected.version
    nc, nw, nq = expected.header.axes.shape
    assert np.array_equal(_figures(described), expected.figures.reshape(nc * nw * nq, len(FIGURES)))
    [cell] = [
        c
        for c in described.cells
        if (c.cell.context_class, c.cell.workload_class, c.cell.qps_level)
        == (answer.cell.context_class, answer.cell.workload_class, answer.cell.qps_level)
    ]
    assert cell.default_decision == answer.default_decision


async def test_a_table_file_changed_in_place_neither_crashes_nor_splits_the_rpcs(tables_dir: Path) -> None:
    path = tables_dir / "a.ppdt"
    write_table_file(path, seed=1)
    served_table = Table.from_bytes(table_bytes(seed=1))
    with serve_process(tables_dir, "--reload-interval", "0.05") as served:
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            stub = pb_grpc.DecisionServiceStub(channel)
            await _assert_serves(stub, served_table)

            # Same size, other content, bad checksum: rejected, and the old table keeps serving intact.
            corrupt = bytearray(table_bytes(seed=2))
            corrupt[-1] ^= 0xFF
            assert len(corrupt) == path.stat().st_size
            await asyncio.to_thread(_rewrite_in_place, path, bytes(corrupt))
            await eventually(rejected_as(served, "checksum"))
            await _assert_serves(stub, served_table)

            # Truncated in place: with a mapping, the next read of the figures would fault (SIGBUS).
            os.truncate(path, path.stat().st_size // 2)
            await eventually(rejected_as(served, "truncated"))
            await _assert_serves(stub, served_table)
            await _assert_serves(stub, served_table)
            assert served.process.poll() is None
        status, log = served.stop()
    assert status == 0, log
    assert "Traceback" not in log

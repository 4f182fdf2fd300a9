"""The launcher's failure paths with real processes and no vLLM: our own interpreter runs
serve_worker.py, which cannot import NIXL or vLLM, so every worker dies before it is ready."""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from simulator.core.topology import Topology
from tests.support.polling import eventually
from vllm_harness.cluster import ClusterSettings, run_cluster
from vllm_harness.prepare import Prepared

pytestmark = pytest.mark.integration


def _prepared(python: Path, tmp_path: Path) -> Prepared:
    return Prepared(python=python, model=tmp_path, served_model="llama-3-tiny-random", vllm_version="0.32.0")


@pytest.mark.parametrize("topology", ["1P1D", "1R"])
async def test_a_worker_that_dies_before_it_is_ready_fails_the_cluster_with_its_last_words(
    topology: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # No CPU NIXL changes: they import NIXL at start, before the command line is read.
    settings = ClusterSettings(
        topology=Topology.parse(topology), pin=False, cpu_nixl_fixes=False, ready_timeout_s=120
    )
    out = io.StringIO()
    code = await run_cluster(_prepared(Path(sys.executable), tmp_path), settings, out, asyncio.Event())
    assert code == 1
    assert out.getvalue() == ""  # no ready line for a cluster that is not up
    assert "exited with code 1 before it was ready" in caplog.text
    assert "ModuleNotFoundError" in caplog.text  # the worker's own stderr (no NIXL, no vLLM here)
    assert "invalid choice" not in caplog.text  # its command line was accepted, a replica's too


async def test_a_stop_while_the_workers_start_ends_the_cluster_cleanly(tmp_path: Path) -> None:
    # A command line no other process on the machine has (a plain "sleep 300" of anyone else's
    # would read as a worker that outlived the cluster): GNU sleep adds up its arguments.
    marker = f"sleep 300 0.{uuid.uuid4().int % 10**12:012d}"
    never_ready = tmp_path / "python"
    never_ready.write_text(f"#!/bin/sh\nexec {marker}\n")
    never_ready.chmod(0o755)
    settings = ClusterSettings(topology=Topology.parse("1P1D"), pin=False, ready_timeout_s=300, grace_s=5)
    stop = asyncio.Event()
    stop.set()  # Ctrl-C before any worker is up
    out = io.StringIO()
    async with asyncio.timeout(60):
        code = await run_cluster(_prepared(never_ready, tmp_path), settings, out, stop)
    assert code == 0
    assert out.getvalue() == ""
    assert not _running(marker)  # no worker outlives the cluster


def _running(command: str) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().replace(b"\0", b" ").strip() == command.encode():
                return True
        except OSError:
            continue
    return False


async def test_the_ready_line_names_each_workers_cores(tmp_path: Path) -> None:
    # Stand-in workers that print a worker's ready line at once and then wait to be stopped.
    ready_at_once = tmp_path / "python"
    ready_at_once.write_text('#!/bin/sh\necho \'{"url": "http://127.0.0.1:9"}\'\nexec sleep 300\n')
    ready_at_once.chmod(0o755)
    pinned = ClusterSettings(topology=Topology.parse("1P1D"), ready_timeout_s=60, grace_s=5)
    unpinned = ClusterSettings(topology=Topology.parse("1P1D"), pin=False, ready_timeout_s=60, grace_s=5)
    lines = []
    for settings in (pinned, unpinned):
        out, stop = io.StringIO(), asyncio.Event()
        task = asyncio.ensure_future(run_cluster(_prepared(ready_at_once, tmp_path), settings, out, stop))

        async def printed(out: io.StringIO = out, task: asyncio.Future[int] = task) -> bool:
            assert not task.done(), "the cluster ended before its ready line"
            return bool(out.getvalue())

        await eventually(printed, timeout_s=60.0, what="the cluster's ready line")
        stop.set()
        assert await task == 0
        lines.append(json.loads(out.getvalue()))
    cores = sorted(os.sched_getaffinity(0))
    pinned_cores = {w["id"]: w["cores"] for w in lines[0]["workers"]}
    if len(cores) >= 2:
        assert pinned_cores == {"P0": str(cores[0]), "D0": ",".join(str(c) for c in cores[1:])}
    assert {w["cores"] for w in lines[1]["workers"]} == {"all"}

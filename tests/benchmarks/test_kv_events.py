"""The KV-event tracking benchmark at test size: it runs and prints every figure (no timing asserts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.kv_events import BenchConfig, main

pytestmark = pytest.mark.bench


def test_small_run_prints_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figures.json"
    assert main(["--small", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for phrase in ("ms CPU per 1k events", "MiB per 100k blocks", "ms per 512-token prompt"):
        assert phrase in text
    figures = json.loads(out.read_text())
    assert figures["cpu"]["events"] >= BenchConfig.small().events
    assert figures["memory"]["blocks"] == BenchConfig.small().resident_blocks
    assert figures["memory"]["bytes"] > 0

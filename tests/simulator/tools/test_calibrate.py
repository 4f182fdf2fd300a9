"""Calibration gate: the model stays within tolerance of the paper's figures and the raw data."""

from __future__ import annotations

import json

import pytest

from simulator.core.profile import load_profile
from simulator.tools.calibrate import interference_figures, kv_transfer_figures, raw_figures
from simulator.tools.cli import main


def test_interference_figures_within_tolerance() -> None:
    figures = interference_figures(load_profile())
    assert len(figures) == 6
    off = [f"{f.name}: model {f.model:.2f} not in [{f.low:.2f}, {f.high:.2f}]" for f in figures if not f.ok]
    assert not off, off


def test_kv_transfer_figures_within_tolerance() -> None:
    figures = kv_transfer_figures(load_profile())
    assert {f.name.split(" over ")[1].split(" ")[0] for f in figures} >= {"nvlink", "ib_hdr", "100gbe"}
    assert all(f.ok for f in figures)


def test_raw_data_across_batch_sizes_within_tolerance() -> None:
    figures = raw_figures(load_profile())
    assert len(figures) == 25
    off = [f"{f.name}: model {f.model:.1f} vs {f.target:.1f} ms" for f in figures if not f.ok]
    assert not off, off


def test_a_miscalibrated_profile_fails_the_gate() -> None:
    bad = load_profile().with_overrides({"cascade.reread_factor": 1.0})
    assert not all(f.ok for f in interference_figures(bad))


def test_calibrate_command_prints_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate"]) == 0
    text = capsys.readouterr().out
    assert "+1 full prefill, B=200" in text
    assert "100gbe" in text
    assert main(["calibrate", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["failures"] == 0

"""Calibration against emulator-model.md 3.1/3.4 (filled in next)."""

from __future__ import annotations

from typing import TextIO

__all__ = ["run_calibration"]


def run_calibration(profile: str, *, as_json: bool, raw: bool, out: TextIO) -> int:
    del profile, as_json, raw
    out.write("calibration: not implemented yet\n")
    return 2

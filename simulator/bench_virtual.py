"""Throughput of the virtual-time cluster simulation (filled in next)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=2000, help="two-turn conversations to simulate")


def run_from_args(args: argparse.Namespace) -> int:
    del args
    return 2

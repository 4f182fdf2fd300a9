"""The argument types ``ppd-bench``'s sub-commands share: one definition each, with one wording of
their errors (argparse prints them as usage errors, exit code 2)."""

from __future__ import annotations

import argparse
import math

__all__ = ["names", "positive", "positive_list", "positive_list_or_none"]


def positive(text: str) -> float:
    """A finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_list(text: str) -> tuple[float, ...]:
    """Comma-separated positive numbers, at least one."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def positive_list_or_none(text: str) -> tuple[float, ...]:
    """Like ``positive_list``, but an empty text means none (the experiment is skipped)."""
    return positive_list(text) if text.strip() else ()


def names(text: str) -> tuple[str, ...]:
    """Comma-separated names, blanks dropped."""
    return tuple(x.strip() for x in text.split(",") if x.strip())

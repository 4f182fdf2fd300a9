"""The argument types ``ppd-bench``'s sub-commands share: one definition each, with one wording of
their errors (argparse prints them as usage errors, exit code 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = [
    "at_least",
    "names",
    "open_unit",
    "positive",
    "positive_list",
    "positive_list_or_none",
    "share",
]


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


def _number(text: str, wanted: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value


def share(text: str) -> float:
    """A number from 0 to 1, both included (a share of requests)."""
    value = _number(text, "a number from 0 to 1")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def open_unit(text: str) -> float:
    """A number strictly between 0 and 1 (a confidence level)."""
    value = _number(text, "a number between 0 and 1 (both excluded)")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1 (both excluded), got {text}")
    return value


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse

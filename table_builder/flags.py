"""The ``ppd-table`` flags that fill a table header (shared by ``build`` and ``sweep``), and the
argument types of the command line.

Every header flag's default is ``table_builder.build.default_header``'s, so a build from the command
line and one from code (``BuildOptions(header=default_header(...))``) write the same header.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

from decision_service.header import DECISIONS, Weights
from ppd.placement import PLACEMENTS
from table_builder.build import BuildOptions, default_header

__all__ = [
    "add_build_options",
    "options_from_args",
    "positive_int",
    "positive_seconds",
    "qps_levels_arg",
    "weights_arg",
]


def weights_arg(text: str) -> Weights:
    """``W_TTFT,W_TPOT``: two finite numbers >= 0, not both zero."""
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W_TTFT,W_TPOT (two numbers), got {text!r}") from None
    if not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < 0 or a == b == 0:
        raise argparse.ArgumentTypeError(f"weights must be finite, >= 0 and not both zero, got {text!r}")
    return Weights(a, b)


def _profile(text: str) -> tuple[str, Weights]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=W_TTFT,W_TPOT, got {text!r}")
    return name, weights_arg(rest)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value


def qps_levels_arg(text: str) -> tuple[float, ...]:
    """``Q1,Q2,...``: the table's QPS axis, finite, positive and strictly increasing."""
    try:
        levels = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of QPS levels, got {text!r}") from None
    if not all(math.isfinite(q) and q > 0 for q in levels):
        raise argparse.ArgumentTypeError(f"QPS levels must be finite and positive, got {text!r}")
    if any(b <= a for a, b in itertools.pairwise(levels)):
        raise argparse.ArgumentTypeError(f"QPS levels must be strictly increasing, got {text!r}")
    return levels


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _limit(text: str) -> int | None:
    if text == "off":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'off', got {text}")
    return value


def add_build_options(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``build`` and ``sweep``: everything that lands in the table header (their
    defaults are ``default_header``'s)."""
    header = default_header(shape="", model="")  # only its defaults are read here
    p.add_argument(
        "--min-samples", type=positive_int, default=20, help="flag cells with fewer requests per mode"
    )
    p.add_argument(
        "--slo", type=_fraction, default=header.min_success, help="minimum success rate of a mode in a cell"
    )
    p.add_argument(
        "--default-decision",
        choices=DECISIONS,
        default=header.default_decision,
        help="answer for cells without data",
    )
    weights = header.default_weights
    p.add_argument(
        "--weights",
        type=weights_arg,
        default=weights,
        help=f"default W_TTFT,W_TPOT ({weights.w_ttft:g},{weights.w_tpot:g})",
    )
    p.add_argument(
        "--profile",
        type=_profile,
        action="append",
        metavar="NAME=W_TTFT,W_TPOT",
        help="a named weights profile (repeatable; replaces the built-in balanced/ttft/tpot)",
    )
    p.add_argument(
        "--max-kv-usage",
        type=_fraction,
        default=header.max_decode_kv_usage,
        help="live decode KV usage above which local turns pd",
    )
    p.add_argument(
        "--max-decode-running",
        type=_limit,
        default=header.max_decode_running,
        metavar="N|off",
        help="decode-load guard: above N running requests on the session's decode worker, local turns pd "
        f"(default {_limit_text(header.max_decode_running)})",
    )
    p.add_argument(
        "--max-prefill-queue",
        type=_limit,
        default=header.max_prefill_queue_depth,
        metavar="N|off",
        help="...unless the prefill queue is deeper than N (then P is the scarcer side; default "
        f"{_limit_text(header.max_prefill_queue_depth)})",
    )
    p.add_argument(
        "--qps-levels",
        type=qps_levels_arg,
        default=None,
        metavar="Q1,Q2,...",
        help="the table's QPS axis, conversations started per second; a live QPS snaps to the nearest "
        "(default: the paper's " + ",".join(f"{q:g}" for q in header.axes.qps_levels) + "; a small "
        "engine's sweep names its own levels so that each gets its own column)",
    )
    p.add_argument(
        "--timeout-ms", type=float, default=30_000.0, help="censored TTFT of a mode that completed nothing"
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=None,
        help="how the measured runs placed P and the Turn-1 D (the gateway's [routing] placement; a "
        "sweep runs its engine with it, and the endpoints engine takes it from the gateway's GET "
        "/admin/workers where it can): recorded in the table header "
        f"(default {header.placement}, the choice of a gateway without [kv_events])",
    )
    p.add_argument(
        "--label",
        type=_label,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="provenance label (repeatable)",
    )
    p.add_argument("--built-at", help="ISO 8601 build time for the provenance (default: from the inputs)")


def _limit_text(limit: int | None) -> str:
    return "off" if limit is None else str(limit)


def options_from_args(
    args: argparse.Namespace,
    *,
    shape: str,
    labels: dict[str, str] | None = None,
    placement: str | None = None,
) -> BuildOptions:
    """The build's options from the flags; ``placement`` (the sweep's engine's) before ``--placement``."""
    defaults = default_header(shape, args.model)
    header = dataclasses.replace(
        defaults,
        default_weights=args.weights,
        profiles=dict(args.profile) if args.profile else defaults.profiles,
        min_success=args.slo,
        default_decision=args.default_decision,
        max_decode_kv_usage=args.max_kv_usage,
        max_decode_running=args.max_decode_running,
        max_prefill_queue_depth=args.max_prefill_queue,
        placement=placement or args.placement or defaults.placement,
    )
    if args.qps_levels is not None:
        header = dataclasses.replace(
            header, axes=dataclasses.replace(header.axes, qps_levels=tuple(args.qps_levels))
        )
    return BuildOptions(
        header=header,
        min_samples=args.min_samples,
        timeout_ms=args.timeout_ms,
        labels={**dict(args.label), **(labels or {})},
        built_at=args.built_at,
    )

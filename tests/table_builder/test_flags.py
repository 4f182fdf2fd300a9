"""The header flags of ppd-table build and sweep: their defaults are the builder's, each one lands."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from decision_service.header import Weights
from table_builder.build import default_header
from table_builder.flags import (
    add_build_options,
    options_from_args,
    positive_int,
    qps_levels_arg,
    weights_arg,
)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="m")
    add_build_options(parser)
    return parser.parse_args(argv)


def test_no_flags_give_the_builders_default_header() -> None:
    options = options_from_args(_parse(), shape="1P3D")
    assert options.header == default_header("1P3D", "m")


def test_every_header_flag_lands_in_the_header() -> None:
    args = _parse(
        "--slo=0.9",
        "--default-decision=local",
        "--weights=1,0.5",
        "--profile=fast=1,0.1",
        "--max-kv-usage=0.8",
        "--max-decode-running=off",
        "--max-prefill-queue=3",
        "--qps-levels=0.1,0.2,0.4",
    )
    header = options_from_args(args, shape="2P2D").header
    assert header == dataclasses.replace(
        default_header("2P2D", "m"),
        min_success=0.9,
        default_decision="local",
        default_weights=Weights(1.0, 0.5),
        profiles={"fast": Weights(1.0, 0.1)},
        max_decode_kv_usage=0.8,
        max_decode_running=None,
        max_prefill_queue_depth=3,
        axes=dataclasses.replace(default_header("2P2D", "m").axes, qps_levels=(0.1, 0.2, 0.4)),
    )


@pytest.mark.parametrize("text", ["1", "a,b", "-1,1", "0,0", "inf,1"])
def test_bad_weights_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        weights_arg(text)


def test_positive_int() -> None:
    assert positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int("0")


@pytest.mark.parametrize("text", ["", "a", "0.1,0", "0.2,0.1", "0.1,0.1", "nan", "1,inf"])
def test_bad_qps_levels_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        qps_levels_arg(text)


def test_seconds_flags_take_positive_finite_numbers() -> None:
    import argparse

    from table_builder.flags import positive_seconds

    assert positive_seconds("2.5") == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_seconds(bad)

"""The table header value type: every field written and read back, the figure names, the checks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from decision_service.axes import paper_axes
from decision_service.header import FIGURES, FIGURES_OF_VERSION, Figure, HeaderError, TableHeader, Weights
from decision_service.table import FORMAT_VERSION
from ppd.decision.v1 import decision_pb2 as pb

#: A header whose every field differs from its default, so that a field lost on the way shows.
FULL = TableHeader(
    shape="2P2D",
    model="m",
    axes=paper_axes(),
    default_weights=Weights(1.0, 0.5),
    profiles={"a": Weights(0.5, 1.0), "b": Weights(2.0, 0.0)},
    min_success=0.9,
    default_decision="local",
    max_decode_kv_usage=0.8,
    max_decode_running=100,
    max_prefill_queue_depth=4,
    provenance={"source": "test", "seed": 3},
    placement="prefix",
)


def test_a_header_reads_back_as_it_was_written() -> None:
    assert TableHeader.from_json(FULL.to_json()) == FULL


def test_every_field_is_written() -> None:
    written = FULL.to_json()
    for f in dataclasses.fields(TableHeader):
        default = TableHeader(shape=FULL.shape, model=FULL.model, axes=FULL.axes)
        value = getattr(FULL, f.name)
        if value == getattr(default, f.name):
            continue  # shape, model, axes: required, so FULL shares them
        assert dataclasses.replace(FULL, **{f.name: getattr(default, f.name)}).to_json() != written, f.name


def test_figure_names_follow_the_array_order_and_the_proto() -> None:
    # The names are part of the file format (every table lists them): they never change.
    assert [(int(f), f.label) for f in Figure] == list(enumerate(FIGURES))
    assert FIGURES == (
        "pd_ttft_ms",
        "pd_tpot_ms",
        "local_ttft_ms",
        "local_tpot_ms",
        "pd_success",
        "local_success",
        "pd_samples",
        "local_samples",
        "bidir_ttft_ms",
        "bidir_tpot_ms",
        "bidir_success",
        "bidir_samples",
    )
    assert set(FIGURES) <= set(pb.CellFigures.DESCRIPTOR.fields_by_name)


def test_each_format_version_lists_a_prefix_of_the_figures() -> None:
    # Columns are only ever appended: version 1 is PD and LOCAL, version 2 adds BIDIR.
    assert FIGURES_OF_VERSION[1] == FIGURES[:8]
    assert FIGURES_OF_VERSION[2] == FIGURES
    assert max(FIGURES_OF_VERSION) == FORMAT_VERSION == 2


@pytest.mark.parametrize("version", [1, 2])
def test_a_header_reads_back_in_each_format_version(version: int) -> None:
    raw = FULL.to_json(version)
    assert raw["figures"] == list(FIGURES_OF_VERSION[version])
    assert TableHeader.from_json(raw, version) == FULL


def test_a_version_1_figures_list_is_refused_in_a_version_2_file() -> None:
    with pytest.raises(HeaderError, match="format version 2"):
        TableHeader.from_json(FULL.to_json(1), 2)


def test_a_table_written_before_the_decode_guard_reads_with_the_guard_off() -> None:
    raw = FULL.to_json()
    del raw["live"]["max_decode_running"], raw["live"]["max_prefill_queue_depth"]
    header = TableHeader.from_json(raw)
    assert (header.max_decode_running, header.max_prefill_queue_depth) == (None, None)


def test_a_table_written_before_placement_reads_as_least_loaded_and_keeps_its_bytes() -> None:
    least = dataclasses.replace(FULL, placement="least_loaded")
    assert "placement" not in least.to_json()  # the header of an earlier table, unchanged
    assert FULL.to_json()["placement"] == "prefix"
    raw = FULL.to_json()
    del raw["placement"]
    assert TableHeader.from_json(raw).placement == "least_loaded"


def _set(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    raw = FULL.to_json()
    section = raw
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("model",), "", "header field 'model' must be a non-empty string"),
        (("key",), "1P3D/m", "is not shape/model"),
        (("default_decision",), "maybe", "default_decision must be 'pd' or 'local'"),
        (("figures",), ["pd_ttft_ms"], "differ from this reader's"),
        (("weights", "default"), {"w_ttft": -1.0, "w_tpot": 1.0}, "weights 'default' must be finite"),
        (("weights", "profiles"), {"z": {"w_ttft": 0.0, "w_tpot": 0.0}}, "weights 'z' are both zero"),
        (("slo", "min_success"), 1.5, "must be within 0..1"),
        (("live", "max_decode_kv_usage"), -0.1, "must be within 0..1"),
        (("live", "max_prefill_queue_depth"), -1, "live.max_prefill_queue_depth must be a whole number"),
        (("placement",), "nearest", "placement must be one of prefix, least_loaded"),
    ],
)
def test_each_check_names_the_field(path: tuple[str, ...], value: Any, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        TableHeader.from_json(_set(path, value))

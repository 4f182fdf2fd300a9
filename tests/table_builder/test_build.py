"""Building a TableSpec: figures per cell, censoring, the summary, determinism, provenance."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

from decision_service.table import FIGURES, Figure, Table, TableError
from table_builder.artifact import read_artifact
from table_builder.build import (
    BuildOptions,
    build_from_artifact,
    build_from_records,
    default_header,
    table_file_name,
)
from table_builder.records import Record
from tests.support.records import ARTIFACT
from tests.support.records import make_record as record

HEADER = default_header("1P3D", "llama-3.1-8b")
OPTIONS = BuildOptions(header=HEADER, min_samples=2)
SMALL_MID_PASTE_2 = (0, 6, 2)


def _pair(**changes: object) -> list[Record]:
    """Two pd and two local Turn-2 records in (small, mid_paste, 2 QPS)."""
    return [
        record(ttft_ms=100.0, tpot_ms=10.0, **changes),
        record(ttft_ms=120.0, tpot_ms=10.0, conversation_id="c2", **changes),
        record(mode="local", path="local", run_id="run-local", ttft_ms=40.0, tpot_ms=11.0, **changes),
        record(
            mode="local",
            path="local",
            run_id="run-local",
            ttft_ms=60.0,
            tpot_ms=11.0,
            conversation_id="c2",
            **changes,
        ),
    ]


def _figures(table: Table, cell: tuple[int, int, int]) -> dict[str, float]:
    return dict(zip(FIGURES, (float(x) for x in table.figures[cell]), strict=True))


def test_a_measured_cell_holds_both_modes_figures() -> None:
    result = build_from_records(_pair(), OPTIONS)
    table = Table.from_bytes(result.encode())
    assert table.key == "1P3D/llama-3.1-8b"
    assert _figures(table, SMALL_MID_PASTE_2) == {
        "pd_ttft_ms": 110.0,
        "pd_tpot_ms": 10.0,
        "local_ttft_ms": 50.0,
        "local_tpot_ms": 11.0,
        "pd_success": 1.0,
        "local_success": 1.0,
        "pd_samples": 2.0,
        "local_samples": 2.0,
        # No bidir records: no BIDIR figures, and the table is a format-1 file.
        "bidir_ttft_ms": 0.0,
        "bidir_tpot_ms": 0.0,
        "bidir_success": 0.0,
        "bidir_samples": 0.0,
    }
    assert table.format_version == 1
    assert "bidir" not in table.header.provenance["cells"]
    assert table.measured(*SMALL_MID_PASTE_2)
    assert result.summary.filled == 1
    assert len(result.summary.missing) == 269
    # Unmeasured cells keep the format's "no data" zeros.
    assert np.count_nonzero(table.figures[..., Figure.PD_SAMPLES]) == 1


def test_a_mode_that_completed_nothing_is_censored_at_the_timeout() -> None:
    records = [
        *_pair(),
        record(ok=False, target_qps=20.0),
        record(ok=False, target_qps=20.0, conversation_id="c2"),
        record(mode="local", path="local", ttft_ms=70.0, tpot_ms=12.0, target_qps=20.0),
    ]
    result = build_from_records(records, OPTIONS)
    table = Table.from_bytes(result.encode())
    fig = _figures(table, (0, 6, 9))
    assert fig["pd_ttft_ms"] == 30_000.0
    assert fig["pd_tpot_ms"] == 12.0  # copied from local: no evidence either way
    assert fig["pd_success"] == 0.0
    assert fig["pd_samples"] == 2.0
    assert [n.label() for n in result.summary.censored] == ["small/mid_paste@20"]
    assert table.header.provenance["censored_cells"] == ["small/mid_paste@20"]
    # The cell has 1 local request: measured, flagged low-sample.
    assert [n.label() for n in result.summary.low_sample] == ["small/mid_paste@20"]


@pytest.mark.parametrize(
    ("extra", "detail"),
    [
        ([record(target_qps=4.0)], "only pd measured"),
        (
            [record(ok=False, target_qps=4.0), record(mode="local", path="local", ok=False, target_qps=4.0)],
            "both modes completed nothing",
        ),
    ],
)
def test_incomplete_cells_are_missing_with_a_reason(extra: list[Record], detail: str) -> None:
    result = build_from_records([*_pair(), *extra], OPTIONS)
    notes = {n.label(): n.detail for n in result.summary.missing}
    assert notes["small/mid_paste@4"] == detail
    assert f"small/mid_paste x1 ({detail})" in result.summary.format()


def test_no_measured_cell_means_no_table() -> None:
    result = build_from_records([record()], OPTIONS)
    with pytest.raises(TableError) as info:
        result.encode()
    assert info.value.reason == "empty"


def test_same_records_in_any_order_give_the_same_bytes() -> None:
    rng = random.Random(3)
    records = []
    for i in range(200):
        mode = rng.choice(["pd", "local"])
        records.append(
            record(
                mode=mode,
                path=mode,
                conversation_id=f"c{i}",
                target_qps=rng.choice([0.5, 2.0, 8.0]),
                ttft_ms=round(rng.uniform(20, 400), 3),
                tpot_ms=round(rng.uniform(8, 14), 3),
                start_time=1_767_225_600.0 + i,
            )
        )
    first = build_from_records(records, OPTIONS).encode()
    assert build_from_records(records, OPTIONS).encode() == first
    rng.shuffle(records)
    assert build_from_records(records, OPTIONS).encode() == first


def test_build_time_comes_from_the_inputs_or_the_option() -> None:
    records = _pair()
    records[1] = record(ttft_ms=120.0, conversation_id="c2", start_time=1_767_312_000.0)
    provenance = Table.from_bytes(build_from_records(records, OPTIONS).encode()).header.provenance
    assert provenance["built_at"] == "2026-01-02T00:00:00Z"
    assert provenance["newest_start_time"] == 1_767_312_000.0
    explicit = BuildOptions(header=HEADER, built_at="2026-02-03T04:05:06Z")
    provenance = Table.from_bytes(build_from_records(records, explicit).encode()).header.provenance
    assert provenance["built_at"] == "2026-02-03T04:05:06Z"
    # Virtual (simulated) clocks start near 0: no calendar date is made up for them.
    virtual = [record(start_time=1.5), *_pair(start_time=2.0)]
    provenance = Table.from_bytes(build_from_records(virtual, OPTIONS).encode()).header.provenance
    assert "built_at" not in provenance


def test_provenance_names_the_inputs() -> None:
    options = BuildOptions(header=HEADER, labels={"hardware": "H100", "engine": "test"})
    table = Table.from_bytes(build_from_records(_pair(), options).encode())
    p = table.header.provenance
    assert p["source"] == "records"
    assert p["runs"] == ["run-local", "run-pd"]
    assert p["labels"] == {"engine": "test", "hardware": "H100"}
    assert len(p["inputs_sha256"]) == 64
    assert p["builder"].startswith("table_builder/")
    assert p["cells"]["filled"] == 0  # two requests per mode < the default 20: low-sample
    assert p["cells"]["low_sample"] == 1


def test_header_carries_weights_slo_and_default() -> None:
    header = dataclasses.replace(
        default_header("3P1D", "m"), min_success=0.9, default_decision="local", max_decode_kv_usage=0.8
    )
    options = BuildOptions(header=header)
    records = [
        *(record(shape="3P1D", model="m", conversation_id=f"c{i}") for i in range(2)),
        *(
            record(shape="3P1D", model="m", mode="local", path="local", conversation_id=f"c{i}")
            for i in range(2)
        ),
    ]
    table = Table.from_bytes(build_from_records(records, options).encode())
    assert table.key == "3P1D/m"
    assert table.header.min_success == 0.9
    assert table.header.default_decision == "local"
    assert table.header.max_decode_kv_usage == 0.8
    assert sorted(table.header.profiles) == ["balanced", "tpot", "ttft"]


def test_artifact_build() -> None:
    result = build_from_artifact(read_artifact([ARTIFACT]).points, OPTIONS)
    table = Table.from_bytes(result.encode())
    assert table.measured(0, 6, 5)
    assert table.header.provenance["source"] == "paper-artifact"
    assert table.header.provenance["built_at"] == "2026-01-18T07:54:47.749909"
    assert [n.label() for n in result.summary.censored] == ["large/huge_paste@20"]
    assert "tiny (16, 32) is classified small_bal" in result.summary.format()
    again = build_from_artifact(tuple(reversed(read_artifact([ARTIFACT]).points)), OPTIONS)
    assert again.encode() == result.encode()


def test_table_file_name() -> None:
    assert table_file_name("1P3D", "llama-3.1-8b") == "1P3D__llama-3.1-8b.ppdt"
    assert table_file_name("1P3D", "meta/llama") == "1P3D__meta_llama.ppdt"


# --- the third mode (issue 17): records of mode bidir ----------------------------------------------


def _bidir(**changes: Any) -> Record:
    """A Turn-2 record of a static bidir run. Built as a pd record and relabelled: whether ``Record``
    accepts mode ``bidir`` is the mode grammar's business (ppd/modes.py, the gateway path's side of
    issue 17); the build reads whatever mode a record carries."""
    rec = record(run_id="run-bidir", **changes)
    object.__setattr__(rec, "mode", "bidir")
    object.__setattr__(rec, "path", "bidir")
    return rec


def test_bidir_records_become_the_third_modes_figures() -> None:
    records = [
        *_pair(),
        _bidir(ttft_ms=70.0, tpot_ms=10.5),
        _bidir(ttft_ms=90.0, tpot_ms=10.5, conversation_id="c2"),
        _bidir(ok=False, conversation_id="c3"),
    ]
    result = build_from_records(records, OPTIONS)
    table = Table.from_bytes(result.encode())
    assert table.format_version == 2
    fig = _figures(table, SMALL_MID_PASTE_2)
    assert (fig["bidir_ttft_ms"], fig["bidir_tpot_ms"], fig["bidir_samples"]) == (80.0, 10.5, 3.0)
    assert fig["bidir_success"] == 2 / 3
    assert (fig["pd_ttft_ms"], fig["local_ttft_ms"]) == (110.0, 50.0)  # the other modes as before
    assert result.summary.bidir == 1
    assert table.header.provenance["cells"]["bidir"] == 1
    assert "run-bidir" in table.header.provenance["runs"]
    assert "1 with bidir figures" in result.summary.format()


def test_a_bidir_that_completed_nothing_is_censored() -> None:
    result = build_from_records([*_pair(), _bidir(ok=False), _bidir(ok=False, conversation_id="c2")], OPTIONS)
    fig = _figures(Table.from_bytes(result.encode()), SMALL_MID_PASTE_2)
    assert (fig["bidir_ttft_ms"], fig["bidir_tpot_ms"], fig["bidir_success"]) == (30_000.0, 10.0, 0.0)
    assert [n.detail for n in result.summary.censored] == ["bidir completed 0/2"]


def test_bidir_alone_does_not_make_a_cell_measured() -> None:
    records = [*_pair(), _bidir(target_qps=4.0)]
    result = build_from_records(records, OPTIONS)
    table = Table.from_bytes(result.encode())
    assert table.format_version == 1  # the only bidir cell has no PD/LOCAL pair: nothing to compare with
    assert {n.label(): n.detail for n in result.summary.missing}["small/mid_paste@4"] == "only bidir measured"


def test_bidir_figures_are_order_free() -> None:
    records = [*_pair(), _bidir(ttft_ms=70.0), _bidir(ttft_ms=91.0, conversation_id="c2")]
    assert (
        build_from_records(records, OPTIONS).encode() == build_from_records(records[::-1], OPTIONS).encode()
    )

"""The table file: round trips, determinism, and one named test per corrupt fixture."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decision_service.axes import paper_axes
from decision_service.table import (
    _REASONS,
    DIGEST_SIZE,
    PREAMBLE,
    Figure,
    Table,
    TableError,
    TableHeader,
    TableSpec,
    Weights,
    encode_table,
    write_table,
)
from tests.support.tables import bad_cases, bad_fixtures, patch_header, row, synthetic_spec, with_header

FIXTURES = Path(__file__).resolve().parent.parent / "testdata" / "tables"


def test_checked_in_fixtures_match_their_generator() -> None:
    for reason, blob in bad_fixtures().items():
        assert (FIXTURES / f"bad_{reason}.ppdt").read_bytes() == blob, reason
    for name, (_, blob, _) in bad_cases().items():
        assert (FIXTURES / f"bad_{name}.ppdt").read_bytes() == blob, name
    assert (FIXTURES / "good.ppdt").read_bytes() == encode_table(synthetic_spec())


def test_good_fixture_opens_with_its_header() -> None:
    table = Table.open(FIXTURES / "good.ppdt")
    try:
        assert table.key == "1P3D/llama-3.1-8b"
        assert table.header.axes == paper_axes()
        assert table.figures.shape == (3, 9, 10, len(Figure))
        assert table.header.profiles["ttft"] == Weights(1.0, 0.2)
        assert table.measured(1, 0, 0)
        assert not table.measured(2, 0, 0)
    finally:
        table.close()


def _reason_of(name: str) -> str:
    with pytest.raises(TableError) as info:
        Table.open(FIXTURES / f"bad_{name}.ppdt")
    return info.value.reason


def test_bad_magic_is_rejected() -> None:
    assert _reason_of("bad_magic") == "bad_magic"


def test_future_version_is_rejected() -> None:
    assert _reason_of("future_version") == "future_version"


def test_truncated_file_is_rejected() -> None:
    assert _reason_of("truncated") == "truncated"


def test_checksum_mismatch_is_rejected() -> None:
    assert _reason_of("checksum") == "checksum"


def test_axes_inconsistent_with_arrays_is_rejected() -> None:
    assert _reason_of("axes") == "axes"


def test_nan_in_figures_is_rejected() -> None:
    assert _reason_of("nan") == "nan"


def test_table_without_measurements_is_rejected() -> None:
    assert _reason_of("empty") == "empty"


def test_header_missing_a_field_is_rejected() -> None:
    assert _reason_of("header") == "header"


def test_negative_figure_is_rejected() -> None:
    with pytest.raises(TableError) as info:
        Table.open(FIXTURES / "bad_figures.ppdt")
    assert info.value.reason == "figures"
    assert "negative figure local_tpot_ms in cell (1, 4, 3)" in str(info.value)


@pytest.mark.parametrize("name", sorted(bad_cases()))
def test_each_figure_and_header_check_has_a_fixture_and_rejects_it(name: str) -> None:
    reason, _, phrase = bad_cases()[name]
    assert name.startswith(f"{reason}--")
    with pytest.raises(TableError) as info:
        Table.open(FIXTURES / f"bad_{name}.ppdt")
    assert info.value.reason == reason
    assert phrase in str(info.value)


def test_every_reader_reason_about_content_has_a_fixture() -> None:
    covered = set(bad_fixtures()) | {reason for reason, _, _ in bad_cases().values()}
    assert covered == set(_REASONS)


def test_decode_guard_limits_round_trip() -> None:
    spec = with_header(synthetic_spec(), max_decode_running=192, max_prefill_queue_depth=8)
    table = Table.from_bytes(encode_table(spec))
    assert (table.header.max_decode_running, table.header.max_prefill_queue_depth) == (192, 8)
    assert table.raw_header["live"]["max_decode_running"] == 192


def test_a_table_written_before_the_decode_guard_loads_with_the_guard_off() -> None:
    def drop(header: dict[str, Any]) -> None:
        del header["live"]["max_decode_running"], header["live"]["max_prefill_queue_depth"]

    guarded = with_header(synthetic_spec(), max_decode_running=192, max_prefill_queue_depth=8)
    table = Table.from_bytes(patch_header(encode_table(guarded), drop))
    assert (table.header.max_decode_running, table.header.max_prefill_queue_depth) == (None, None)


@pytest.mark.parametrize("bad", [-1, 1.5, "9", True])
def test_a_bad_decode_guard_limit_is_a_header_error(bad: object) -> None:
    def put(header: dict[str, Any]) -> None:
        header["live"]["max_decode_running"] = bad

    with pytest.raises(TableError) as info:
        Table.from_bytes(patch_header(encode_table(synthetic_spec()), put))
    assert info.value.reason == "header"
    assert "max_decode_running" in str(info.value)


def test_zero_byte_file_is_empty(tmp_path: Path) -> None:
    (tmp_path / "zero.ppdt").write_bytes(b"")
    with pytest.raises(TableError) as info:
        Table.open(tmp_path / "zero.ppdt")
    assert info.value.reason == "empty"


def test_same_spec_gives_same_bytes_and_version_tracks_content() -> None:
    a, b = encode_table(synthetic_spec()), encode_table(synthetic_spec())
    assert a == b
    other = Table.from_bytes(encode_table(synthetic_spec(seed=8)))
    assert other.version != Table.from_bytes(a).version


def test_arrays_are_aligned_to_64_bytes() -> None:
    table = Table.from_bytes(encode_table(synthetic_spec()))
    assert table.raw_header["arrays"][0]["offset"] % 64 == 0


@pytest.mark.parametrize(
    "path",
    [FIXTURES / "good.ppdt", *sorted((FIXTURES.parent.parent.parent / "tables").rglob("*.ppdt"))],
    ids=lambda p: p.name if p.parent.name != "example" else f"example/{p.name}",
)
def test_a_table_read_and_written_again_is_the_same_bytes(path: Path) -> None:
    """The header value type carries every field: nothing a reader drops, nothing a writer adds."""
    blob = path.read_bytes()
    table = Table.from_bytes(blob)
    assert encode_table(TableSpec(table.header, table.figures)) == blob


def test_write_publishes_atomically_and_leaves_no_temp(tmp_path: Path) -> None:
    path = write_table(tmp_path / "t.ppdt", synthetic_spec())
    assert [p.name for p in tmp_path.iterdir()] == ["t.ppdt"]
    assert Table.open(path).key == "1P3D/llama-3.1-8b"


def test_encoder_refuses_a_spec_it_could_not_read() -> None:
    spec = synthetic_spec()
    bad = TableSpec(spec.header, spec.figures[:, :, :-1])
    with pytest.raises(TableError, match="axes"):
        encode_table(bad)


_figure = st.floats(min_value=0.5, max_value=1e5, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(
    ttft=_figure,
    tpot=_figure,
    success=st.floats(min_value=0.0, max_value=1.0),
    samples=st.integers(min_value=1, max_value=10_000),
    w=st.tuples(st.floats(0.01, 10), st.floats(0.0, 10)),
    profile=st.text(alphabet="abcdefgh_", min_size=1, max_size=12),
)
def test_write_read_round_trip(
    ttft: float, tpot: float, success: float, samples: int, w: tuple[float, float], profile: str
) -> None:
    axes = paper_axes()
    fig = np.zeros((*axes.shape, len(Figure)))
    fig[...] = row(
        pd_ttft_ms=ttft,
        pd_tpot_ms=tpot,
        local_ttft_ms=ttft / 2,
        local_tpot_ms=tpot * 1.1,
        pd_success=success,
        local_success=1.0,
        pd_samples=samples,
        local_samples=samples,
    )
    header = TableHeader(
        shape="2P2D", model="m", axes=axes, default_weights=Weights(*w), profiles={profile: Weights(*w)}
    )
    table = Table.from_bytes(encode_table(TableSpec(header, fig)))
    assert np.array_equal(table.figures, fig)
    assert table.header == header


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_any_single_byte_corruption_is_rejected_cleanly(position: int, xor: int) -> None:
    good = bytearray(encode_table(synthetic_spec()))
    i = position % len(good)
    good[i] ^= xor or 1
    with pytest.raises(TableError):
        Table.from_bytes(bytes(good))


def test_an_open_table_never_sees_its_file_rewritten_in_place(tmp_path: Path) -> None:
    path = write_table(tmp_path / "t.ppdt", synthetic_spec(seed=1))
    table = Table.open(path)
    before = table.figures.copy()
    other = encode_table(synthetic_spec(seed=2))
    assert len(other) == path.stat().st_size
    with open(path, "r+b") as fh:  # same size, same inode: what `cp` over the file does
        fh.write(other)
    assert np.array_equal(table.figures, before)
    assert not table.figures.flags.writeable
    assert table.measured(1, 0, 0)


# --- format version 2: the bidirectional mode's columns (issue 17) ---------------------------------


def _bidir_spec(**bidir: float) -> TableSpec:
    spec = synthetic_spec()
    fig = spec.figures.copy()
    fig[1, 5, 3, Figure.BIDIR_TTFT_MS] = bidir.get("ttft", 30.0)
    fig[1, 5, 3, Figure.BIDIR_TPOT_MS] = bidir.get("tpot", 9.5)
    fig[1, 5, 3, Figure.BIDIR_SUCCESS] = bidir.get("success", 1.0)
    fig[1, 5, 3, Figure.BIDIR_SAMPLES] = bidir.get("samples", 40.0)
    return TableSpec(spec.header, fig)


def test_a_table_with_bidir_samples_is_written_as_version_2_and_reads_back() -> None:
    spec = _bidir_spec()
    blob = encode_table(spec)
    magic, version, _, _ = PREAMBLE.unpack_from(blob, 0)
    assert (magic, version) == (b"PPDTABLE", 2)
    table = Table.from_bytes(blob)
    assert table.format_version == 2
    assert table.raw_header["figures"][-4:] == [
        "bidir_ttft_ms",
        "bidir_tpot_ms",
        "bidir_success",
        "bidir_samples",
    ]
    np.testing.assert_array_equal(table.figures, spec.figures)
    assert table.has_bidir(1, 5, 3)
    assert not table.has_bidir(1, 5, 2)
    assert encode_table(spec) == blob  # deterministic


def test_a_version_1_spec_of_eight_columns_is_still_accepted() -> None:
    spec = synthetic_spec()
    eight = TableSpec(spec.header, spec.figures[..., :8].copy())
    assert encode_table(eight) == encode_table(spec)


def test_figures_of_another_width_are_refused() -> None:
    spec = synthetic_spec()
    with pytest.raises(TableError, match="last axis must be 8 or 12"):
        encode_table(TableSpec(spec.header, spec.figures[..., :10].copy()))


@pytest.mark.parametrize(
    ("bidir", "message"),
    [
        ({"ttft": 0.0}, "zero BIDIR TTFT or TPOT"),
        ({"tpot": 0.0}, "zero BIDIR TTFT or TPOT"),
        ({"success": 1.5}, "success rates must be within 0..1"),
        ({"ttft": -1.0}, "negative figure bidir_ttft_ms"),
    ],
)
def test_bad_bidir_figures_are_refused(bidir: dict[str, float], message: str) -> None:
    with pytest.raises(TableError, match=message):
        encode_table(_bidir_spec(**bidir))


def test_zero_bidir_latency_without_samples_is_no_figure() -> None:
    assert Table.from_bytes(encode_table(_bidir_spec(ttft=0.0, tpot=0.0, samples=0.0))).format_version == 1


def test_a_version_2_header_in_a_version_1_file_is_refused() -> None:
    blob = encode_table(_bidir_spec())
    magic, _, reserved, hlen = PREAMBLE.unpack_from(blob, 0)
    body = PREAMBLE.pack(magic, 1, reserved, hlen) + blob[PREAMBLE.size : -DIGEST_SIZE]
    with pytest.raises(TableError, match="format version 1"):
        Table.from_bytes(body + hashlib.sha256(body).digest())

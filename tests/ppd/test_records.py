"""The benchmark record schema (ppd/records.py): one definition, checked on construction by `Record`,
unchecked for a live writer (`UncheckedRecord`). The reader's line-by-line reports:
tests/table_builder/test_records.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ppd.records import FIELDS, OPTIONAL_FIELDS, Record, RecordError, UncheckedRecord
from tests.support.records import make_record


def test_the_field_order_is_the_schema_order() -> None:
    schema = [*FIELDS, *OPTIONAL_FIELDS]
    assert [f.name for f in dataclasses.fields(UncheckedRecord)] == schema
    assert [f.name for f in dataclasses.fields(Record)] == schema
    assert list(json.loads(make_record().to_json())) == list(FIELDS)
    assert list(json.loads(make_record(explored=True, propensity=0.1).to_json())) == schema


def test_optional_fields_are_left_out_exactly_when_all_hold_their_defaults() -> None:
    plain = make_record()
    defaults = {name: default for name, (_, default) in OPTIONAL_FIELDS.items()}
    assert Record(**{**plain.to_dict(), **defaults}).to_json() == plain.to_json()
    assert Record.from_json(plain.to_json()) == plain
    # A chosen request under exploration: not explored, but its propensity is 1 - epsilon.
    chosen = make_record(propensity=0.9)
    assert json.loads(chosen.to_json())["explored"] is False
    explored = make_record(explored=True, propensity=0.1)
    line = explored.to_json()
    assert line.endswith(',"explored":true,"propensity":0.1}')
    assert Record.from_json(line) == explored
    assert Record.from_json(line.replace('"propensity":0.1', '"propensity":1')).propensity == 1.0


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"propensity": 0.0}, r"propensity must lie in \(0, 1\]"),
        ({"propensity": 1.5}, r"propensity must lie in \(0, 1\]"),
        ({"propensity": float("nan")}, "must be finite"),
        ({"explored": 1}, "'explored' must be bool"),
        ({"explored": True, "turn": 1, "n_ctx": 0}, "explored is true on turn 1"),
    ],
)
def test_bad_exploration_fields_are_refused(changes: dict[str, object], why: str) -> None:
    with pytest.raises(RecordError, match=why):
        make_record(**changes)


def test_an_unchecked_record_keeps_what_a_record_refuses() -> None:
    values = {**make_record().to_dict(), "run_id": "", "turn": 0}
    assert UncheckedRecord(**values).to_dict() == values
    with pytest.raises(RecordError, match="must not be empty"):
        Record(**values)


@pytest.mark.parametrize("mode", ["pd", "local", "ppd", "replica", "bidir", "fraction:0.25"])
def test_every_mode_of_the_grammar_is_a_valid_record_mode(mode: str) -> None:
    assert make_record(mode=mode).mode == mode


def test_the_bidirectional_path_is_a_valid_record_path() -> None:
    assert make_record(mode="bidir", path="bidir").path == "bidir"


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("PD", "routing mode 'PD' is not one of"),  # the grammar is exact in records
        ("fraction:2", r"fraction must lie in \[0, 1\]"),
        ("fraction:x", "fraction is not a number"),
    ],
)
def test_a_mode_outside_the_grammar_is_refused(mode: str, why: str) -> None:
    with pytest.raises(RecordError, match=why):
        make_record(mode=mode)


def test_only_a_production_line_may_leave_its_workload_unlabelled() -> None:
    # The gateway's log as deployed: no target_qps, no workload label; the refresh classifies it.
    production = make_record(target_qps=0.0, workload="")
    assert Record.from_json(production.to_json()) == production
    with pytest.raises(RecordError, match="'workload' must not be empty"):
        make_record(target_qps=2.0, workload="")
    for name in ("run_id", "shape", "model", "conversation_id"):
        with pytest.raises(RecordError, match=f"{name!r} must not be empty"):
            make_record(target_qps=0.0, **{name: ""})

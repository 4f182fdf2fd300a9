"""The benchmark record schema (ppd/records.py): one definition, checked on construction by `Record`,
unchecked for a live writer (`UncheckedRecord`). The reader's line-by-line reports:
tests/table_builder/test_records.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ppd.records import FIELDS, Record, RecordError, UncheckedRecord
from tests.support.records import make_record


def test_the_field_order_is_the_schema_order() -> None:
    assert [f.name for f in dataclasses.fields(UncheckedRecord)] == list(FIELDS)
    assert [f.name for f in dataclasses.fields(Record)] == list(FIELDS)
    assert list(json.loads(make_record().to_json())) == list(FIELDS)


def test_an_unchecked_record_keeps_what_a_record_refuses() -> None:
    values = {**make_record().to_dict(), "run_id": "", "turn": 0}
    assert UncheckedRecord(**values).to_dict() == values
    with pytest.raises(RecordError, match="must not be empty"):
        Record(**values)


@pytest.mark.parametrize("mode", ["pd", "local", "ppd", "replica", "fraction:0.25"])
def test_every_mode_of_the_grammar_is_a_valid_record_mode(mode: str) -> None:
    assert make_record(mode=mode).mode == mode


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

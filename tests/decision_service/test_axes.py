"""The axes of a table: the paper's, read back from their JSON, and each inconsistency refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from decision_service.axes import Axes, AxesError, paper_axes


def test_the_paper_axes_are_valid_and_read_back_from_json() -> None:
    axes = paper_axes()
    axes.validate()
    assert axes.shape == (3, 9, 10)
    assert Axes.from_json(axes.to_json()) == axes


def _edited(edit: dict[str, Any]) -> dict[str, Any]:
    raw = paper_axes().to_json()
    for section, value in edit.items():
        if section == "qps_levels":
            raw["qps_levels"] = value
        else:
            raw["context"][section] = value
    return raw


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"edges": [4096, 512]}, "strictly increasing"),
        ({"classes": ["small", "large"]}, "2 context edges need 3 classes"),
        ({"qps_levels": [2.0, 1.0]}, "strictly increasing"),
        ({"qps_levels": []}, "no QPS levels"),
    ],
)
def test_inconsistent_axes_are_refused(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(AxesError, match=message):
        Axes.from_json(_edited(edit))


def test_a_classifier_naming_an_unknown_class_is_refused() -> None:
    axes = paper_axes()
    classifier = dataclasses.replace(axes.classifier, prefill_classes=("mid_paste", "big_paste", "nope"))
    with pytest.raises(AxesError, match="unknown workload classes"):
        dataclasses.replace(axes, classifier=classifier).validate()

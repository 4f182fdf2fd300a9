"""Fault-injection settings: updates and validation (pure values)."""

from __future__ import annotations

import pytest

from simulator.core.api_error import ApiError
from simulator.core.faults import Faults


def test_faults_update_and_validation() -> None:
    faults = Faults().updated({"error_rate": 0.5, "down_after_requests": 3})
    assert faults.error_rate == 0.5
    assert faults.down_after_requests == 3
    assert faults.updated({"error_rate": None}).error_rate == 0.0
    assert faults.as_json()["down_after_requests"] == 3
    for bad in ({"error_rate": 2}, {"down": "yes"}, {"nope": 1}, {"down_after_requests": -1}, [1]):
        with pytest.raises(ApiError):
            faults.updated(bad)

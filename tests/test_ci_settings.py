"""The suite's CI mode: the Hypothesis profile CI loads, property tests without the 200 ms deadline, and a
missing tool that fails a test under CI instead of skipping it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

import tests.gateway.test_sse as sse_tests
from tests.support.ci import CI_PROFILE, hypothesis_profile, require_tool, running_in_ci


def test_ci_profile_has_no_deadline_and_is_derandomized() -> None:
    profile = settings.get_profile(CI_PROFILE)
    assert profile.deadline is None
    assert profile.derandomize


@pytest.mark.parametrize(
    ("environ", "profile"),
    [
        ({"CI": "true"}, "ci"),
        ({"CI": "1"}, "ci"),
        ({}, "default"),
        ({"CI": ""}, "default"),
        ({"CI": "false"}, "default"),
    ],
)
def test_the_ci_profile_is_chosen_when_ci_is_set(environ: dict[str, str], profile: str) -> None:
    assert hypothesis_profile(environ) == profile


def test_the_loaded_profile_follows_the_environment() -> None:
    """conftest.py loaded the profile: under CI=true every property test runs without a deadline."""
    current = settings()  # the loaded profile's values
    if running_in_ci():
        assert current.deadline is None
        assert current.derandomize
    else:
        assert not current.derandomize


@pytest.mark.parametrize(
    "test",
    [
        sse_tests.test_any_split_gives_the_same_events,
        sse_tests.test_raw_bytes_are_exactly_the_completed_events,
    ],
)
def test_sse_property_tests_have_no_deadline(test: object) -> None:
    # Where @settings(...) puts a test's settings; without it, the profile default (200 ms) applies.
    chosen = getattr(test, "_hypothesis_internal_use_settings", None)
    assert chosen is not None
    assert chosen.deadline is None


def test_a_missing_tool_skips_outside_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="cc"):
        require_tool("cc", "a C compiler")


def test_a_missing_tool_fails_under_ci(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="not allowed under CI"):
        require_tool("cc", "a C compiler")


def test_a_present_tool_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    require_tool("sh", "a shell")

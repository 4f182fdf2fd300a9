"""Engines by name: the built-in analytic one and the plug-ins of the entry-point group."""

from __future__ import annotations

import pytest

from table_builder.engines import DEFAULT_ENGINE, PLUGIN_GROUP, EngineOptions, engine_names, make_engine


def test_the_simulator_reaches_the_sweep_as_a_plug_in() -> None:
    assert engine_names()[0] == "analytic"
    assert DEFAULT_ENGINE in engine_names()
    engine = make_engine("sim", EngineOptions(seed=3, duration_s=2.0))
    assert engine.name == "sim"
    assert engine.settings()["seed"] == 3
    assert engine.settings()["duration_s"] == 2.0


def test_the_built_in_engine_needs_no_plug_in() -> None:
    assert make_engine("analytic", EngineOptions()).name == "analytic"


def test_an_unknown_engine_names_the_known_ones_and_the_group() -> None:
    with pytest.raises(ValueError, match="unknown engine 'gpu'") as caught:
        make_engine("gpu", EngineOptions())
    assert "known: analytic, endpoints, sim, vllm-cpu" in str(caught.value)
    assert PLUGIN_GROUP in str(caught.value)


def test_the_running_deployment_options_are_ignored_by_the_other_engines() -> None:
    options = EngineOptions(seed=3, url="http://10.0.0.1:8000", workers=("decode=http://d:8200",))
    assert make_engine("sim", options).settings()["seed"] == 3
    assert make_engine("analytic", options).name == "analytic"
    with pytest.raises(ValueError, match="the endpoints engine needs --url"):
        make_engine("endpoints", EngineOptions(seed=3))


def test_the_admin_token_never_shows_in_the_options_repr() -> None:
    assert "s3cret" not in repr(EngineOptions(admin_token="s3cret"))

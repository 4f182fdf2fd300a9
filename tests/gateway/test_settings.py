"""TOML settings: defaults for everything, typos and bad values rejected at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import Settings, SettingsError
from ppd.modes import Mode

EXAMPLE = Path(__file__).resolve().parents[2] / "gateway" / "example.toml"


def test_empty_config_is_valid() -> None:
    s = Settings.from_mapping({})
    assert s.mode == Mode("ppd")
    assert s.decision.deadline_ms == 5.0
    assert s.sessions.ttl_s == 3600.0
    assert s.pool.heartbeat_expiry_s == 30.0
    assert s.workers == ()


def test_the_shipped_example_parses(tmp_path: Path) -> None:
    s = Settings.from_toml(EXAMPLE)
    assert {w.role for w in s.workers} == {"prefill", "decode"}


def test_full_config(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text(
        """
mode = "fraction:0.5"
admin_token = "t"
[[workers]]
id = "P0"
role = "prefill"
url = "http://127.0.0.1:8100/"
[decision]
address = "127.0.0.1:50051"
deadline_ms = 3
stream = true
fallback = "local"
[policy]
prefill_failure = "error"
[sessions]
ttl_s = 60
max_entries = 10
"""
    )
    s = Settings.from_toml(path)
    assert s.mode == Mode("fraction", 0.5)
    assert s.workers[0].url == "http://127.0.0.1:8100"
    assert (s.decision.deadline_ms, s.decision.stream, s.decision.fallback) == (3.0, True, "local")
    assert s.policy.prefill_failure == "error"
    assert (s.sessions.ttl_s, s.sessions.max_entries) == (60.0, 10)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"mod": "pd"}, "unknown setting"),
        ({"decision": {"deadline": 3}}, "unknown setting"),
        ({"mode": "turbo"}, "routing mode"),
        ({"decision": {"deadline_ms": "5"}}, "must be float"),
        ({"decision": {"fallback": "maybe"}}, "fallback"),
        ({"policy": {"prefill_attempts": 0}}, "prefill_attempts"),
        ({"sessions": {"max_entries": 0}}, "positive"),
        ({"sessions": {"prefix_candidates": 0}}, "prefix_candidates"),
        ({"sessions": {"prefix_candidates": 65}}, "prefix_candidates"),
        ({"workers": [{"id": "a", "role": "decode", "url": "x"}]}, "url"),
        ({"workers": [{"id": "a", "role": "decode", "url": "http://a:1"}] * 2}, "duplicate"),
        ({"decision": 3}, "must be a table"),
        ({"allow_mode_header": "yes"}, "must be bool"),
        ({"routing": {"bidir": 1}}, "must be bool"),
        ({"routing": {"bidir_params_ttl_s": 0}}, "bidir_params_ttl_s"),
        ({"routing": {"bidir_params_ttl_s": float("inf")}}, "bidir_params_ttl_s"),
    ],
)
def test_bad_configs_are_rejected(data: dict[str, object], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        Settings.from_mapping(data)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        Settings.from_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("mode = ")
    with pytest.raises(SettingsError, match="cannot read"):
        Settings.from_toml(bad)


def test_limits_are_configurable_and_checked() -> None:
    s = Settings.from_mapping({"limits": {"max_messages": 10, "max_id_length": 64, "header_timeout_s": 5}})
    assert (s.limits.max_messages, s.limits.max_id_length, s.limits.header_timeout_s) == (10, 64, 5.0)
    assert Settings.from_toml(EXAMPLE).limits == Settings().limits  # the example shows the defaults
    for bad in ({"max_messages": 0}, {"max_id_length": 0}, {"header_timeout_s": 0}, {"max_bytes": 1}):
        with pytest.raises(SettingsError):
            Settings.from_mapping({"limits": bad})


def test_the_routing_section_says_whether_the_gateway_can_serve_bidir() -> None:
    assert (Settings().routing.bidir, Settings().routing.bidir_params_ttl_s) == (False, 450.0)
    s = Settings.from_mapping({"mode": "bidir", "routing": {"bidir": True, "bidir_params_ttl_s": 30}})
    assert (str(s.mode), s.routing.bidir, s.routing.bidir_params_ttl_s) == ("bidir", True, 30.0)


def test_the_streaming_client_is_chosen_in_the_upstream_section() -> None:
    assert Settings.from_mapping({}).upstream.stream_client == "aiohttp"
    chosen = Settings.from_mapping({"upstream": {"stream_client": "httptools", "keepalive_s": 5}})
    assert (chosen.upstream.stream_client, chosen.upstream.keepalive_s) == ("httptools", 5.0)
    with pytest.raises(SettingsError, match="stream_client"):
        Settings.from_mapping({"upstream": {"stream_client": "httpx"}})
    with pytest.raises(SettingsError, match="keepalive_s"):
        Settings.from_mapping({"upstream": {"keepalive_s": 0}})


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), float("inf")])
def test_the_pickers_observe_share_is_a_share(share: float) -> None:
    assert Settings().log.picker_observe_share == 0.05
    assert Settings.from_mapping({"log": {"picker_observe_share": 1}}).log.picker_observe_share == 1.0
    with pytest.raises(SettingsError, match=r"log\.picker_observe_share must be between 0 and 1"):
        Settings.from_mapping({"log": {"picker_observe_share": share}})

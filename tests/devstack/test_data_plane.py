"""ppd-up's Envoy data plane (devstack/data_plane.py): the failure mode it renders and the workers
Envoy may pick by itself. The stack running it: tests/devstack/test_stack.py; through the real Envoy:
tests/deploy/test_envoy_picker_failover.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from devstack.data_plane import picker_envoy_config, worker_localities
from devstack.stack import parse_settings


def _ext_proc(config_text: str) -> dict[str, Any]:
    config = yaml.safe_load(config_text)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    typed: dict[str, Any] = ext["typed_config"]
    return typed


def test_the_picker_fails_closed_unless_ppd_up_is_told_open() -> None:
    assert parse_settings(["--data-plane", "envoy"])[0].picker_failure_mode == "closed"
    settings = parse_settings(["--data-plane", "envoy", "--picker-failure-mode", "open"])[0]
    assert settings.picker_failure_mode == "open"
    workers = [{"id": "D0", "role": "decode", "url": "http://127.0.0.1:8200"}]
    closed = picker_envoy_config(port=0, picker_grpc=1, workers=workers)
    opened = picker_envoy_config(port=0, picker_grpc=1, workers=workers, failure_mode="open")
    assert (_ext_proc(closed)["failure_mode_allow"], _ext_proc(opened)["failure_mode_allow"]) == (False, True)
    with pytest.raises(SystemExit):
        parse_settings(["--data-plane", "envoy", "--picker-failure-mode", "ajar"])


def test_envoys_workers_are_decode_and_replicas_first_prefill_only_when_named() -> None:
    """devstack/data_plane.py rule 2: Envoy's own round robin (fail-open) never lands on a P."""
    workers = [
        {"id": "P0", "role": "prefill", "url": "http://127.0.0.1:1001"},
        {"id": "D0", "role": "decode", "url": "http://127.0.0.1:1002"},
        {"id": "R0", "role": "replica", "url": "http://10.0.0.9:1003"},
    ]
    localities = worker_localities(workers)
    by_priority = {
        locality["priority"]: [
            (
                e["endpoint"]["address"]["socket_address"]["address"],
                e["endpoint"]["address"]["socket_address"]["port_value"],
            )
            for e in locality["lb_endpoints"]
        ]
        for locality in localities
    }
    assert by_priority == {0: [("127.0.0.1", 1002), ("10.0.0.9", 1003)], 1: [("127.0.0.1", 1001)]}

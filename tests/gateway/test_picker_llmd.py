"""llm-d's decode-sidecar convention (`[routing] llmd_sidecar`, picker.py rule 7, core.py rule 8):
the picker names P in `x-prefiller-host-port` and runs no P leg. Hand-built ext_proc messages over the
fakes of tests/gateway/fakes.py; through the real Envoy and a stand-in sidecar:
tests/deploy/test_envoy_picker_llmd.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.picker import DESTINATION_HEADER, PREFILLER_HEADER, Picker
from gateway.settings import Settings, SettingsError
from tests.gateway.fakes import FakeUpstream, forwarder_on_fakes
from tests.gateway.test_picker import (
    FIRST,
    MODEL,
    RESPONSE_HEADERS,
    WORKERS,
    _body,
    _chat,
    _headers,
    _process,
    _routed,
    _set_headers,
)
from tests.support.metrics import sample

HISTORY = [*FIRST, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
CLIENT_SENT = {PREFILLER_HEADER: "10.9.9.9:1", DESTINATION_HEADER: "10.9.9.9:2"}


def _picker(mode: str = "local", **extra: Any) -> tuple[Picker, Any, FakeUpstream]:
    upstream = FakeUpstream()
    config = {
        "mode": mode,
        "served_model": MODEL,
        "workers": WORKERS,
        "routing": {"llmd_sidecar": True},
        **extra,
    }
    _, deps = forwarder_on_fakes(config, upstream=upstream)
    return Picker(deps, draw=lambda: 1.0), deps, upstream


def _provenance(answers: list[pb.ProcessingResponse]) -> dict[str, str]:
    return _set_headers(answers[-1].response_headers.response.header_mutation)


async def test_a_pd_turn_names_p_to_ds_sidecar_and_runs_no_p_leg() -> None:
    picker, deps, upstream = _picker()
    client_params = {"remote_host": "10.9.9.9", "do_remote_prefill": True}
    answers = await _process(
        picker,
        _headers(extra=CLIENT_SENT),
        _body(_chat(FIRST, stream=True, kv_transfer_params=client_params)),
        RESPONSE_HEADERS,
    )
    headers, body, common = _routed(answers)
    assert upstream.calls == []  # the sidecar runs the P leg
    assert headers[DESTINATION_HEADER] == "10.0.0.2:8002"  # D0: its sidecar
    assert headers[PREFILLER_HEADER] == "10.0.0.1:8001"  # P0, not the client's
    assert PREFILLER_HEADER not in common.header_mutation.remove_headers
    assert body == _chat(FIRST, stream=True)  # no P params, the client's dropped, nothing added
    assert headers["content-length"] == str(len(common.body_mutation.body))
    provenance = _provenance(answers)
    assert (provenance["x-ppd-path"], provenance["x-ppd-reason"]) == ("pd", "turn_one")
    assert (provenance["x-ppd-prefill-worker"], provenance["x-ppd-decode-worker"]) == ("P0", "D0")
    labels = {"path": "pd", "reason": "turn_one"}
    assert sample(deps.metrics.registry, "ppd_gateway_decisions_total", labels) == 1


async def test_a_local_turn_names_no_prefiller_and_removes_the_clients() -> None:
    picker, _, upstream = _picker()
    await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    answers = await _process(picker, _headers(extra=CLIENT_SENT), _body(_chat(HISTORY)), RESPONSE_HEADERS)
    headers, body, common = _routed(answers)
    assert PREFILLER_HEADER not in headers
    assert PREFILLER_HEADER in common.header_mutation.remove_headers
    assert headers[DESTINATION_HEADER] == "10.0.0.2:8002"
    assert "kv_transfer_params" not in body
    assert (_provenance(answers)["x-ppd-path"], _provenance(answers)["x-ppd-turn"]) == ("local", "2")
    assert upstream.calls == []


async def test_a_bidir_turn_is_a_plain_pd_for_the_sidecar() -> None:
    """The sidecar sends a plain P leg: a bidir decision is served as pd (the picker never holds D's
    params anyway: it does not read D's answer)."""
    picker, _, upstream = _picker(mode="bidir")
    await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    answers = await _process(picker, _headers(), _body(_chat(HISTORY)), RESPONSE_HEADERS)
    headers, body, _ = _routed(answers)
    assert headers[PREFILLER_HEADER] == "10.0.0.1:8001"
    assert "kv_transfer_params" not in body
    assert _provenance(answers)["x-ppd-path"] == "pd"
    assert upstream.calls == []


async def test_in_full_duplex_the_prefiller_rides_on_the_headers_answer() -> None:
    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    headers = _headers()
    headers.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=duplex))
    picker, _, _ = _picker()
    answers = await _process(picker, headers, _body(_chat(FIRST)))
    mutation = answers[0].request_headers.response.header_mutation
    assert _set_headers(mutation)[PREFILLER_HEADER] == "10.0.0.1:8001"
    assert json.loads(answers[1].request_body.response.body_mutation.streamed_response.body) == _chat(FIRST)


async def test_a_p_configured_by_name_is_named_by_its_address_or_is_a_502() -> None:
    by_name = [{"id": "P0", "role": "prefill", "url": "http://localhost:8001"}, WORKERS[1]]
    picker, _, _ = _picker(workers=by_name)
    answers = await _process(picker, _headers(), _body(_chat(FIRST)))
    assert _routed(answers)[0][PREFILLER_HEADER] == "127.0.0.1:8001"
    nowhere = [{"id": "P0", "role": "prefill", "url": "http://prefill-0.nowhere.invalid:8001"}, WORKERS[1]]
    picker, deps, _ = _picker(workers=nowhere)
    answers = await _process(picker, _headers(), _body(_chat(FIRST)))
    assert answers[1].immediate_response.status.code == 502
    assert "worker P0's host" in json.loads(answers[1].immediate_response.body)["error"]["message"]
    assert len(deps.sessions) == 0  # no turn remembered on a P the sidecar cannot reach


async def test_no_live_p_is_an_immediate_503() -> None:
    picker, deps, _ = _picker()
    deps.pool.mark_failed("P0")
    answers = await _process(picker, _headers(), _body(_chat(FIRST)))
    assert answers[1].immediate_response.status.code == 503


async def test_off_by_default_the_picker_runs_the_p_leg_itself() -> None:
    picker, _, upstream = _picker(routing={})
    answers = await _process(picker, _headers(), _body(_chat(FIRST)))
    assert PREFILLER_HEADER not in _routed(answers)[0]
    assert [c.worker for c in upstream.calls] == ["P0"]


def test_the_sidecar_mode_and_bidir_exclude_each_other() -> None:
    with pytest.raises(SettingsError, match="exclude each other"):
        Settings.from_mapping({"routing": {"llmd_sidecar": True, "bidir": True}})
    with pytest.raises(SettingsError, match="must be bool"):
        Settings.from_mapping({"routing": {"llmd_sidecar": "yes"}})

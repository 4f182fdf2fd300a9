"""GIE's subset hint (gateway/picker_subset.py, picker.py rule 8) on hand-built ext_proc messages as
Envoy sends them with `metadata_options.forwarding_namespaces` listing `envoy.lb.subset_hint`, over
the fakes of tests/gateway/fakes.py. Through the real Envoy: tests/deploy/test_envoy_picker_llmd.py."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from gateway.picker import DESTINATION_HEADER, Picker
from gateway.picker_subset import SUBSET_KEY, SUBSET_NAMESPACE, subset_hint
from tests.gateway.fakes import FakeUpstream, forwarder_on_fakes
from tests.gateway.test_picker import (
    FIRST,
    MODEL,
    RESPONSE_HEADERS,
    _body,
    _chat,
    _headers,
    _process,
    _routed,
    _set_headers,
)

P0, D0, D1 = "10.0.0.1:8001", "10.0.0.2:8002", "10.0.0.3:8003"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": f"http://{P0}"},
    {"id": "D0", "role": "decode", "url": f"http://{D0}"},
    {"id": "D1", "role": "decode", "url": f"http://{D1}"},
]


def _picker(**extra: Any) -> tuple[Picker, Any, FakeUpstream]:
    upstream = FakeUpstream()
    config = {"mode": "local", "served_model": MODEL, "workers": WORKERS, **extra}
    _, deps = forwarder_on_fakes(config, upstream=upstream)
    return Picker(deps, draw=lambda: 1.0), deps, upstream


def _hinted(message: pb.ProcessingRequest, value: Any, *, key: str = SUBSET_KEY) -> pb.ProcessingRequest:
    """`message` with the hint in its metadata_context, as Envoy forwards a namespace."""
    hint = struct_pb2.Struct()
    hint.update({key: value})
    message.metadata_context.CopyFrom(base_pb2.Metadata(filter_metadata={SUBSET_NAMESPACE: hint}))
    return message


def _headers_with(value: Any, path: str = "/v1/chat/completions", **kw: Any) -> pb.ProcessingRequest:
    return _hinted(_headers(path, **kw), value)


def _provenance(answers: Sequence[pb.ProcessingResponse]) -> dict[str, str]:
    return _set_headers(answers[-1].response_headers.response.header_mutation)


def _error(answer: pb.ProcessingResponse) -> tuple[int, str]:
    immediate = answer.immediate_response
    return immediate.status.code, json.loads(immediate.body)["error"]["message"]


# ------------------------------------------------------------------ reading the hint


@pytest.mark.parametrize(
    ("value", "inside", "outside"),
    [
        ([D1], [D1], [D0]),
        ([f"{D0}, {D1}"], [D0, D1], [P0]),  # a comma list inside a list entry
        (f"{D1},{P0}", [D1, P0], [D0]),  # one flat string (a header-to-metadata rule's)
        (["10.0.0.3"], [D1, "10.0.0.3:9"], [D0]),  # a bare IP admits every port
        (["[::1]:8002", "nonsense", "10.0.0.2:99999", "::1:8002"], ["[::1]:8002"], [D0, "[::1]:1"]),
        ([], [], [D0, D1]),  # an empty list admits nothing
        (7, [], [D0]),  # a value of another type binds and admits nothing
    ],
)
def test_a_hint_admits_exactly_its_entries(value: Any, inside: list[str], outside: list[str]) -> None:
    subset = subset_hint(_headers_with(value))
    assert subset is not None
    assert [d for d in inside if subset.admits(d)] == inside
    assert [d for d in outside if subset.admits(d)] == []


def test_no_hint_key_is_no_hint() -> None:
    assert subset_hint(_headers()) is None
    assert subset_hint(_hinted(_headers(), [D1], key="another-key")) is None


# ------------------------------------------------------------------ choosing inside it


async def test_a_completion_goes_to_a_d_inside_the_hint_and_p_is_not_narrowed() -> None:
    picker, _, upstream = _picker()
    answers = await _process(picker, _headers_with([D1]), _body(_chat(FIRST)), RESPONSE_HEADERS)
    headers, _, _ = _routed(answers)
    assert headers[DESTINATION_HEADER] == D1  # D0 ranks first without the hint (equal load, id)
    assert answers[1].dynamic_metadata["envoy.lb"][DESTINATION_HEADER] == D1
    assert [c.worker for c in upstream.calls] == ["P0"]  # P is not the destination: never narrowed
    assert _provenance(answers)["x-ppd-decode-worker"] == "D1"


async def test_without_a_hint_the_whole_pool_is_chosen_from() -> None:
    picker, _, _ = _picker()
    answers = await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    assert _routed(answers)[0][DESTINATION_HEADER] == f"{D0},{D1}"  # D0, then the fallback D1


async def test_a_session_whose_d_is_outside_the_hint_goes_through_p_to_one_inside() -> None:
    picker, _, upstream = _picker()
    first = await _process(picker, _headers(), _body(_chat(FIRST)), RESPONSE_HEADERS)
    assert _routed(first)[0][DESTINATION_HEADER] == f"{D0},{D1}"  # D0, then the fallback D1
    history = [*FIRST, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}]
    second = await _process(picker, _headers_with(D1), _body(_chat(history)), RESPONSE_HEADERS)
    assert _routed(second)[0][DESTINATION_HEADER] == D1
    provenance = _provenance(second)
    assert (provenance["x-ppd-path"], provenance["x-ppd-reason"], provenance["x-ppd-turn"]) == (
        "pd",
        "decode_gone",
        "2",
    )
    assert [c.worker for c in upstream.calls] == ["P0", "P0"]  # the KV rebuilt through P


@pytest.mark.parametrize("value", [[], [P0], ["10.9.9.9:8002"], [D1]])
async def test_no_live_d_inside_the_hint_is_an_immediate_503_naming_the_subset(value: list[str]) -> None:
    picker, deps, upstream = _picker()
    deps.pool.mark_failed("D1")  # inside [D1] but down
    answers = await _process(picker, _headers_with(value), _body(_chat(FIRST)))
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "immediate_response"]
    status, message = _error(answers[1])
    assert status == 503
    assert message == "no live decode worker in the gateway's endpoint subset (envoy.lb.subset_hint)"
    assert upstream.calls == []  # no P leg for a turn with nowhere to go


async def test_a_duplex_completion_keeps_the_hint_of_its_headers() -> None:
    duplex = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    headers = _headers_with([D1])
    headers.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=duplex))
    picker, _, _ = _picker()
    answers = await _process(picker, headers, _body(_chat(FIRST)))
    mutation = answers[0].request_headers.response.header_mutation
    assert _set_headers(mutation)[DESTINATION_HEADER] == D1


async def test_a_worker_configured_by_name_is_matched_by_its_address() -> None:
    workers = [WORKERS[0], WORKERS[1], {"id": "D1", "role": "decode", "url": "http://localhost:8003"}]
    picker, _, _ = _picker(workers=workers)
    answers = await _process(picker, _headers_with(["127.0.0.1:8003"]), _body(_chat(FIRST)))
    assert _routed(answers)[0][DESTINATION_HEADER] == "127.0.0.1:8003"


# ------------------------------------------------------------------ pass-through


async def test_a_pass_through_goes_to_any_worker_inside_the_hint_or_is_a_503() -> None:
    picker, _, _ = _picker()
    inside = await _process(picker, _headers_with([P0], "/v1/models", method="GET", end=True))
    mutation = inside[0].request_headers.response.header_mutation
    assert _set_headers(mutation)[DESTINATION_HEADER] == P0  # a P is a pass-through's destination
    nowhere = await _process(picker, _headers_with(["10.9.9.9"], "/v1/models", method="GET", end=True))
    assert _error(nowhere[0]) == (
        503,
        "no live decode worker in the gateway's endpoint subset (envoy.lb.subset_hint)",
    )

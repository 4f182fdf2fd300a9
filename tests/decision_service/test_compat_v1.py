"""Issue 17's promise: a table without the third mode and a caller without the capability see exactly
the answers they saw before format version 2 and CAPABILITY_BIDIR existed, byte for byte."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from decision_service.holder import TableSet
from decision_service.route import Router, check_query
from decision_service.servicer import _describe, _query, _response
from decision_service.table import Figure, Table, TableSpec, encode_table
from ppd.decision.v1 import decision_pb2 as pb
from tests.support.make_v1_answers import ANSWERS, GOOD
from tests.support.tables import synthetic_spec


def _answer(router: Router, req: pb.RouteRequest) -> bytes:
    query = _query(req)
    check_query(query, router.table)
    return _response(router.route(query), router.table, req.request_id).SerializeToString()


@cache
def _recorded() -> tuple[list[tuple[pb.RouteRequest, bytes]], bytes]:
    pairs, describe = [], b""
    for line in ANSWERS.read_text(encoding="utf-8").splitlines():
        item: dict[str, Any] = json.loads(line)
        if "describe" in item:
            describe = bytes.fromhex(item["describe"])
        else:
            req = pb.RouteRequest.FromString(bytes.fromhex(item["request"]))
            pairs.append((req, bytes.fromhex(item["response"])))
    return pairs, describe


def test_a_version_1_file_still_loads_as_version_1() -> None:
    table = Table.open(GOOD)
    assert table.format_version == 1
    assert table.figures.shape[-1] == len(Figure)
    assert not table.figures[..., Figure.BIDIR_SAMPLES].any()
    assert not table.figures.flags.writeable


def test_a_version_1_table_answers_as_the_format_1_code_did() -> None:
    router = Router(Table.open(GOOD))
    pairs, _ = _recorded()
    assert len(pairs) == 600
    for req, recorded in pairs:
        assert _answer(router, req) == recorded, req.request_id


def test_a_capable_caller_gets_the_same_answers_from_a_version_1_table() -> None:
    router = Router(Table.open(GOOD))
    for req, recorded in _recorded()[0]:
        capable = pb.RouteRequest()
        capable.CopyFrom(req)
        capable.capabilities.append(pb.CAPABILITY_BIDIR)
        assert _answer(router, capable) == recorded, req.request_id


def test_describe_table_of_a_version_1_table_is_unchanged() -> None:
    table = Table.open(GOOD)
    router = Router(table)
    tables = TableSet(routers={table.key: router}, default_key=table.key, default=router)
    # Deterministic serialisation on both sides: protobuf writes a map's entries in no fixed order.
    recorded = pb.DescribeTableResponse.FromString(_recorded()[1]).SerializeToString(deterministic=True)
    assert _describe(router, tables).SerializeToString(deterministic=True) == recorded


def test_a_two_mode_table_is_written_exactly_as_before() -> None:
    # The builder's output for a table without BIDIR figures: the same bytes as good.ppdt (format 1).
    assert encode_table(synthetic_spec()) == GOOD.read_bytes()


def _with_bidir(spec: TableSpec, seed: int) -> TableSpec:
    """``spec`` plus BIDIR figures in most measured cells, some failing the SLO, some winning."""
    import numpy as np

    rng = np.random.default_rng(seed)
    fig = spec.figures.copy()
    pd_ttft, pd_tpot = fig[..., Figure.PD_TTFT_MS], fig[..., Figure.PD_TPOT_MS]
    fig[..., Figure.BIDIR_TTFT_MS] = pd_ttft * rng.uniform(0.2, 1.2, pd_ttft.shape)
    fig[..., Figure.BIDIR_TPOT_MS] = pd_tpot * rng.uniform(0.95, 1.2, pd_tpot.shape)
    fig[..., Figure.BIDIR_SUCCESS] = rng.choice([1.0, 0.99, 0.5], pd_ttft.shape)
    fig[..., Figure.BIDIR_SAMPLES] = rng.choice([0, 40], pd_ttft.shape, p=[0.2, 0.8])
    return dataclasses.replace(spec, figures=fig)


@cache
def _pair() -> tuple[Router, Router]:
    """The same PD/LOCAL figures without (format 1) and with (format 2) BIDIR figures."""
    spec = synthetic_spec()
    old, new = Table.from_bytes(encode_table(spec)), Table.from_bytes(encode_table(_with_bidir(spec, 5)))
    assert (old.format_version, new.format_version) == (1, 2)
    return Router(old), Router(new)


_REQUESTS = st.builds(
    pb.RouteRequest,
    request_id=st.text(max_size=4),
    turn=st.integers(1, 6),
    new_input_tokens=st.integers(0, 20_000),
    expected_output_tokens=st.integers(0, 5_000),
    context_tokens=st.integers(0, 300_000),
    qps=st.floats(0, 40, allow_nan=False),
    weights_profile=st.sampled_from(["", "ttft", "tpot", "balanced"]),
)
_WEIGHTS = st.none() | st.tuples(st.floats(0.01, 10), st.floats(0, 10))
_KV = st.none() | st.floats(0, 1)


def _build(req: pb.RouteRequest, weights: tuple[float, float] | None, kv: float | None) -> pb.RouteRequest:
    if weights is not None:
        req.weights.w_ttft, req.weights.w_tpot = weights
    if kv is not None:
        req.live.decode_kv_usage = kv
    return req


@settings(max_examples=300, deadline=None)
@given(req=_REQUESTS, weights=_WEIGHTS, kv=_KV)
def test_without_the_capability_bidir_figures_change_nothing(
    req: pb.RouteRequest, weights: tuple[float, float] | None, kv: float | None
) -> None:
    old, new = _pair()
    req = _build(req, weights, kv)
    got = pb.RouteResponse.FromString(_answer(new, req))
    assert got.table_version == new.table.version
    got.table_version = old.table.version  # the content version differs, as the content does
    assert got.SerializeToString() == _answer(old, req)


@settings(max_examples=300, deadline=None)
@given(req=_REQUESTS, weights=_WEIGHTS, kv=_KV)
def test_without_bidir_figures_the_capability_changes_nothing(
    req: pb.RouteRequest, weights: tuple[float, float] | None, kv: float | None
) -> None:
    old, _ = _pair()
    req = _build(req, weights, kv)
    capable = pb.RouteRequest()
    capable.CopyFrom(req)
    capable.capabilities.append(pb.CAPABILITY_BIDIR)
    assert _answer(old, capable) == _answer(old, req)


@settings(max_examples=300, deadline=None)
@given(req=_REQUESTS, weights=_WEIGHTS, kv=_KV)
def test_only_a_capable_caller_ever_gets_bidir(
    req: pb.RouteRequest, weights: tuple[float, float] | None, kv: float | None
) -> None:
    _, new = _pair()
    req = _build(req, weights, kv)
    plain = pb.RouteResponse.FromString(_answer(new, req))
    assert pb.DECISION_BIDIR not in (plain.decision, plain.default_decision)
    capable = pb.RouteRequest()
    capable.CopyFrom(req)
    capable.capabilities.append(pb.CAPABILITY_BIDIR)
    answer = pb.RouteResponse.FromString(_answer(new, capable))
    if answer.decision == pb.DECISION_BIDIR:
        assert answer.score > 0 or answer.reason == pb.REASON_PD_FAILED_IN_CELL
        assert not answer.alternative_allowed


def test_the_pair_answers_bidir_somewhere() -> None:
    # The property tests above are not vacuous: the format-2 table does answer BIDIR to capable callers.
    _, new = _pair()
    req = pb.RouteRequest(turn=2, new_input_tokens=128, expected_output_tokens=128, context_tokens=1000)
    decisions = set()
    for qps in (0.5, 1, 2, 4, 6, 8, 10, 12, 16, 20):
        for n_in, n_out in ((8, 64), (128, 128), (1024, 32), (512, 512)):
            req.qps, req.new_input_tokens, req.expected_output_tokens = qps, n_in, n_out
            req.capabilities[:] = [pb.CAPABILITY_BIDIR]
            decisions.add(pb.RouteResponse.FromString(_answer(new, req)).decision)
    assert pb.DECISION_BIDIR in decisions

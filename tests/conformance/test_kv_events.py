"""vLLM's KV cache events (docs/vllm-protocol.md 10), asserted identically on the simulator and on real
vLLM: the same P/D request gives the same BlockStored events (fields, block size, tokens per block)
with the same hash chain, for the PYTHONHASHSEED both clusters run with (conftest.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import zmq

from ppd.kv_events import END_SEQ, BlockHasher, BlockStored, EventBatch, decode_batch, decode_seq, encode_seq
from tests.conformance.conftest import KV_EVENTS_SEED
from tests.conformance.workers import Cluster, http
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

BLOCK = 32  # real vLLM's CPU block size; the simulated cluster is started with it


def replay(endpoint: str, start: int = 0) -> list[tuple[int, EventBatch]]:
    """Every batch the worker still buffers from ``start`` on (vLLM's ROUTER replay socket)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", encode_seq(start)))
        out: list[tuple[int, EventBatch]] = []
        while True:
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((decode_seq(seq), decode_batch(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()


def _next_seq(endpoint: str) -> int:
    batches = replay(endpoint)
    return batches[-1][0] + 1 if batches else 0


def _stored(endpoint: str, start: int, chain: set[int]) -> list[BlockStored]:
    """The BlockStored events since ``start`` that name a block of ``chain``."""
    return [
        e
        for _, b in replay(endpoint, start)
        for e in b.events
        if isinstance(e, BlockStored) and chain.intersection(e.block_hashes)
    ]


def _worker(cluster: Cluster, worker_id: str) -> dict[str, Any]:
    return next(w for w in cluster.workers if w["id"] == worker_id)


def _check_events(events: list[BlockStored], tokens: list[int], chain: list[int]) -> list[int]:
    """Each event as vLLM writes it; returns the hashes in event order."""
    hashes: list[int] = []
    for e in events:
        assert e.block_size == BLOCK
        assert (e.medium, e.lora_id, e.lora_name) == ("GPU", None, None)
        n = len(e.block_hashes)
        assert dict(e.extra) == {
            "extra_keys": [None] * n,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        first = 0 if e.parent_block_hash is None else chain.index(e.parent_block_hash) + 1  # type: ignore[arg-type]
        assert list(e.block_hashes) == chain[first : first + len(e.block_hashes)]
        assert list(e.token_ids) == tokens[first * BLOCK : (first + len(e.block_hashes)) * BLOCK]
        hashes.extend(e.block_hashes)  # type: ignore[arg-type]
    return hashes


def test_a_pd_request_publishes_vllms_block_stored_events(cluster: Cluster) -> None:
    p, d = cluster.ids("prefill")[0], cluster.ids("decode")[0]
    pw, dw = _worker(cluster, p), _worker(cluster, d)
    assert "kv_events_replay" in pw, "the cluster was started without KV events"
    assert "kv_events_replay" in dw
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "tell me about the sea " * 20}]
    tokenized = http(cluster.url(d) + "/tokenize", {"model": cluster.model, "messages": messages})
    assert tokenized.status == 200
    tokens: list[int] = tokenized.json()["tokens"]
    chain = BlockHasher(KV_EVENTS_SEED, BLOCK).chain(tokens)
    assert len(chain) >= 3
    p_from, d_from = _next_seq(pw["kv_events_replay"]), _next_seq(dw["kv_events_replay"])

    body: dict[str, Any] = {"model": cluster.model, "messages": messages, "temperature": 0}
    leg = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    first = http(cluster.url(p) + "/v1/chat/completions", leg)
    assert first.status == 200, first.body
    second = http(
        cluster.url(d) + "/v1/chat/completions",
        {**body, "max_tokens": 2, "kv_transfer_params": first.json()["kv_transfer_params"]},
    )
    assert second.status == 200, second.body

    wanted = set(chain)
    p_events: list[BlockStored] = []
    d_events: list[BlockStored] = []

    def published() -> bool:
        p_events[:] = _stored(pw["kv_events_replay"], p_from, wanted)
        d_events[:] = _stored(dw["kv_events_replay"], d_from, wanted)
        p_seen = {h for e in p_events for h in e.block_hashes}
        d_seen = {h for e in d_events for h in e.block_hashes}
        return wanted <= p_seen and wanted <= d_seen

    wait_until(published, deadline_s=60.0, what="P's and D's BlockStored events for the prompt", poll_s=0.2)
    # P computed the prompt, D received it over NIXL: both announce every full prompt block, once, in order.
    assert _check_events(p_events, tokens, chain) == chain
    assert _check_events(d_events, tokens, chain) == chain
    assert p_events[0].parent_block_hash is None
    assert d_events[0].parent_block_hash is None


def test_sequence_numbers_start_at_zero_without_gaps(cluster: Cluster) -> None:
    for worker in cluster.workers:
        seqs = [seq for seq, _ in replay(worker["kv_events_replay"])]
        assert seqs == list(range(len(seqs)))

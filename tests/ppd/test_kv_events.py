"""ppd/kv_events.py against vLLM 0.32's own bytes and hashes (captured from vllm.distributed.kv_events
and vllm.v1.core.kv_cache_utils in the real-vLLM venv), plus round-trip and chain properties."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppd.kv_events import (
    DEFAULT_NONE_HASH_SEED,
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    none_hash_seed,
)

# msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[1, 2],
# parent_block_hash=None, token_ids=[1, 2, 3], block_size=16, lora_id=None, medium="GPU",
# lora_name=None, group_idx=0), BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0),
# AllBlocksCleared()], data_parallel_rank=0)) under vLLM 0.32.0.
VLLM_BATCH = bytes.fromhex(
    "93cb3ff80000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b170"
    "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647393010203aa626c6f636b5f73697a6510a76c6f"
    "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f6964780084a474797065ac"
    "426c6f636b52656d6f766564ac626c6f636b5f6861736865739103a66d656469756da3475055a967726f75705f69"
    "64780081a474797065b0416c6c426c6f636b73436c656172656400"
)
# init_none_hash(sha256); hash_block_tokens over tokens 0..15 then 16..31; maybe_convert_block_hash.
VLLM_CHAIN_DEFAULT_SEED = [3262291359910021016, 7142137847444424233]
VLLM_CHAIN_SEED_0 = [7982712666671721126, 12675106281628537544]


def _sample() -> EventBatch:
    return EventBatch(
        1.5,
        (
            BlockStored((1, 2), None, (1, 2, 3), 16, extra={"group_idx": 0}),
            BlockRemoved((3,), extra={"group_idx": 0}),
            AllBlocksCleared(),
        ),
        0,
    )


def test_encoding_is_vllms_byte_for_byte() -> None:
    assert encode_batch(_sample()) == VLLM_BATCH


def test_decodes_vllms_batch() -> None:
    assert decode_batch(VLLM_BATCH) == _sample()


def test_hash_chain_is_vllms_for_the_default_seed_and_for_pythonhashseed() -> None:
    assert BlockHasher().chain(list(range(32))) == VLLM_CHAIN_DEFAULT_SEED
    assert BlockHasher.from_environ({}).chain(list(range(32))) == VLLM_CHAIN_DEFAULT_SEED
    assert BlockHasher.from_environ({"PYTHONHASHSEED": "0"}).chain(list(range(32))) == VLLM_CHAIN_SEED_0
    assert none_hash_seed({}) == DEFAULT_NONE_HASH_SEED


def test_a_partial_trailing_block_has_no_hash() -> None:
    assert len(BlockHasher().chain(list(range(47)))) == 2
    assert BlockHasher().chain(list(range(15))) == []


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0, [{"type": "Nope"}], 0]),
        msgpack.packb(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "x", "block_size": 16}]]
        ),
        msgpack.packb(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}]]
        ),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": "x"}], 0]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [{(1, 2): 1}], 0]),  # a map keyed by an array: msgpack raises TypeError
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": [1]}], 0]),
    ],
)
def test_malformed_batches_are_refused(payload: bytes) -> None:
    with pytest.raises(KvEventError):
        decode_batch(payload)


def test_sequence_numbers_are_8_byte_big_endian() -> None:
    assert encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert decode_seq(encode_seq(-1)) == -1
    with pytest.raises(KvEventError):
        decode_seq(b"\x00")


_hash = st.one_of(st.integers(0, (1 << 64) - 1), st.binary(min_size=32, max_size=32))
_extra = st.dictionaries(
    st.sampled_from(["group_idx", "session_id"]), st.integers(0, 3) | st.text(max_size=4)
)
_event = st.one_of(
    st.builds(
        BlockStored,
        block_hashes=st.lists(_hash, max_size=4).map(tuple),
        parent_block_hash=st.none() | _hash,
        token_ids=st.lists(st.integers(0, 200_000), max_size=40).map(tuple),
        block_size=st.integers(1, 64),
        lora_id=st.none() | st.integers(0, 9),
        medium=st.sampled_from(["GPU", "CPU", None]),
        lora_name=st.none() | st.text(max_size=5),
        extra=_extra,
    ),
    st.builds(BlockRemoved, block_hashes=st.lists(_hash, max_size=4).map(tuple), extra=_extra),
    st.just(AllBlocksCleared()),
)


@given(
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(_event, max_size=6).map(tuple),
    rank=st.none() | st.integers(0, 7),
)
def test_encode_decode_round_trip(
    ts: float, events: tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...], rank: int | None
) -> None:
    batch = EventBatch(ts, events, rank)
    assert decode_batch(encode_batch(batch)) == batch


@given(
    tokens=st.lists(st.integers(0, 150_000), max_size=80),
    tail=st.lists(st.integers(0, 150_000), max_size=40),
    seed=st.text(max_size=6),
)
def test_chain_prefix_property(tokens: list[int], tail: list[int], seed: str) -> None:
    """A prompt's hashes start with the hashes of any prefix of it; a change in one block changes
    that block's hash and every later one."""
    hasher = BlockHasher(seed, block_size=8)
    whole = hasher.chain(tokens + tail)
    assert whole[: len(tokens) // 8] == hasher.chain(tokens)
    if len(tokens) >= 8:
        changed = [tokens[0] + 1, *tokens[1:]]
        assert set(hasher.chain(changed)).isdisjoint(hasher.chain(tokens))

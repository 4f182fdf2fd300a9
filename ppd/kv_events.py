"""vLLM's KV cache events: the event types, their msgpack wire form, and the block hash chain.

One definition shared by the simulator (which publishes these events) and the gateway (which
subscribes to them and recomputes the hashes of a prompt). The facts this follows, read from vLLM
0.32's own source, are in docs/vllm-protocol.md section 10:

- A publisher sends 3-frame ZMQ messages ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
  counter from 0, ``payload`` one msgpack ``EventBatch`` = array ``[ts, events, data_parallel_rank]``.
- An event is a msgpack map tagged by ``"type"``: ``BlockStored``, ``BlockRemoved`` or
  ``AllBlocksCleared``; fields left at their default (None) are omitted, except the ones vLLM
  declares without a default (``lora_id``, ``medium``, ``lora_name``, ``parent_block_hash``).
- Block *i* of a sequence has hash ``H_i = sha256(pickle((H_{i-1}, tuple(tokens_i), None)))`` with
  ``H_{-1} = NONE_HASH = sha256(pickle(seed))``, ``seed`` = ``PYTHONHASHSEED`` if set, else
  ``"vllm-none-hash"``. Events carry the low 64 bits of ``H_i`` as an integer (vLLM's default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); the chain itself uses the full 32-byte digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHasher",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEvent",
    "KvEventError",
    "KvEventsConfig",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "external_hash",
    "none_hash_seed",
    "parse_kv_events_config",
]

#: The seed of NONE_HASH when PYTHONHASHSEED is not set and the hash is sha256 (vLLM's default).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: The sequence number a replay answer ends with (8 bytes, big-endian, signed -1).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MASK64 = (1 << 64) - 1
BlockHashValue = int | bytes


class KvEventError(ValueError):
    """A message that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHashValue, ...]
    parent_block_hash: BlockHashValue | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    #: The optional fields vLLM omits when None (group_idx, extra_keys, session_id, ...), as received.
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHashValue, ...]
    medium: str | None = "GPU"
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = 0


def _event_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
            **{k: v for k, v in event.extra.items() if v is not None},
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            **{k: v for k, v in event.extra.items() if v is not None},
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """The payload frame vLLM's ZmqEventPublisher sends for ``batch`` (msgspec's array-like struct)."""
    body: list[Any] = [batch.ts, [_event_map(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def _hashes(value: Any, what: str) -> tuple[BlockHashValue, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise KvEventError(f"{what}: block_hashes must be a list of integers or bytes")
    return tuple(value)


_STORED_FIELDS = frozenset(
    {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}
)
_REMOVED_FIELDS = frozenset({"type", "block_hashes", "medium"})


def _decode_event(raw: Any) -> KvEvent:
    if not isinstance(raw, dict):
        raise KvEventError("an event must be a map")
    kind = raw.get("type")
    if not isinstance(raw.get("medium"), str | None):
        raise KvEventError("medium must be a string or nil")
    if kind == "BlockStored":
        tokens = raw.get("token_ids")
        size = raw.get("block_size")
        parent = raw.get("parent_block_hash")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise KvEventError("BlockStored: token_ids must be a list of integers")
        if not isinstance(size, int) or size <= 0:
            raise KvEventError("BlockStored: block_size must be a positive integer")
        if parent is not None and not isinstance(parent, int | bytes):
            raise KvEventError("BlockStored: parent_block_hash must be an integer, bytes or nil")
        return BlockStored(
            block_hashes=_hashes(raw.get("block_hashes"), "BlockStored"),
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=size,
            lora_id=raw.get("lora_id"),
            medium=raw.get("medium"),
            lora_name=raw.get("lora_name"),
            extra={k: v for k, v in raw.items() if k not in _STORED_FIELDS},
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(raw.get("block_hashes"), "BlockRemoved"),
            medium=raw.get("medium"),
            extra={k: v for k, v in raw.items() if k not in _REMOVED_FIELDS},
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatch:
    """Parse one payload frame; raises KvEventError for anything that is not a KVEventBatch (whatever
    the decoder raised: msgpack raises TypeError for a map keyed by an array, for one)."""
    try:
        return _decode_batch(payload)
    except KvEventError:
        raise
    except Exception as exc:  # any failure to decode is a malformed message
        raise KvEventError(f"{type(exc).__name__}: {exc}") from None


def _decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise KvEventError(f"not msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise KvEventError("a batch must be an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KvEventError("a batch must be [float ts, list of events, ...]")
    if rank is not None and not isinstance(rank, int):
        raise KvEventError("data_parallel_rank must be an integer")
    return EventBatch(float(ts), tuple(_decode_event(e) for e in events), rank)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError("a sequence number is 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


# ---------------------------------------------------------------------------------- the flag


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig (the fields and defaults of vllm/config/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def offset(self, index: int) -> KvEventsConfig:
        """The config of the ``index``-th worker of a cluster: tcp ports + index (vLLM's rule for data
        parallel ranks; port 0 stays 0)."""

        def shift(endpoint: str | None) -> str | None:
            if not endpoint or index == 0 or not endpoint.startswith("tcp://"):
                return endpoint
            base, _, port = endpoint.rpartition(":")
            return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"

        ep = shift(self.endpoint)
        return KvEventsConfig(
            self.enable_kv_cache_events,
            self.publisher,
            ep if ep is not None else self.endpoint,
            shift(self.replay_endpoint),
            self.buffer_steps,
            self.hwm,
            self.max_queue_size,
            self.topic,
        )


def parse_kv_events_config(raw: str) -> KvEventsConfig:
    """``--kv-events-config`` JSON; raises ValueError naming what is wrong."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config: expected a JSON object")
    known = {f.name for f in fields(KvEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
    config = KvEventsConfig(**data)
    if config.publisher not in (None, "zmq", "null"):
        raise ValueError("--kv-events-config: publisher must be zmq or null")
    if config.buffer_steps <= 0 or config.hwm < 0:
        raise ValueError("--kv-events-config: buffer_steps must be positive, hwm non-negative")
    return config


# ---------------------------------------------------------------------------------- the hash chain


def none_hash_seed(environ: Mapping[str, str]) -> str:
    """The NONE_HASH seed vLLM resolves for sha256: PYTHONHASHSEED if set, else the fixed default."""
    return environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def external_hash(digest: bytes) -> int:
    """The integer an event carries for a block digest (the low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & _MASK64


class BlockHasher:
    """vLLM's prefix-caching block hashes (``--prefix-caching-hash-algo sha256``, the default) for
    a given NONE_HASH seed; ``BlockHasher.from_environ(os.environ)`` resolves it as vLLM does."""

    __slots__ = ("block_size", "none_hash", "seed")

    def __init__(self, seed: str = DEFAULT_NONE_HASH_SEED, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.seed = seed
        self.block_size = block_size
        self.none_hash = _sha256(seed)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, block_size: int = 16) -> BlockHasher:
        return cls(none_hash_seed(os.environ if environ is None else environ), block_size)

    def digest(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """vLLM's hash_block_tokens(sha256, parent, tokens, extra_keys=None)."""
        return _sha256((parent or self.none_hash, tuple(tokens), None))

    def digests(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Digests of the full blocks of ``token_ids`` (a trailing partial block has none)."""
        bs = self.block_size
        out: list[bytes] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.digest(parent, token_ids[start : start + bs])
            out.append(parent)
        return out

    def chain(self, token_ids: Sequence[int]) -> list[int]:
        """The hashes events carry for the full blocks of ``token_ids``, block 0 first."""
        return [external_hash(d) for d in self.digests(token_ids)]

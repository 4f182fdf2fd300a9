"""A simulated worker's KV cache events, published as vLLM's ZmqEventPublisher does.

``--kv-events-config '<json>'`` takes vLLM's KVEventsConfig fields (docs/vllm-protocol.md 10.1).
The engine's block pool tells :class:`KvEventPublisher` (a ``BlockEventSink``) what it caches and
evicts; after each engine step the driver calls :meth:`KvEventPublisher.flush`, which sends the step's
events as one batch ``(topic, seq, msgpack)`` on a PUB socket and keeps it for the optional ROUTER
replay socket (the last ``buffer_steps`` batches). Encoding and hashes: ppd/kv_events.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from ppd.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    KvEventsConfig,
    encode_batch,
    encode_seq,
)
from simulator.core.kv_cache import BlockContent

__all__ = ["KvEventPublisher"]

_log = logging.getLogger(__name__)
_GROUP = {"group_idx": 0}  # vLLM's one KV cache group for a plain decoder model


class KvEventPublisher:
    """The BlockEventSink of one worker: collects a step's events, publishes them as one batch."""

    def __init__(
        self, config: KvEventsConfig, *, block_size: int, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._config = config
        self._block_size = block_size
        self._clock = wall_clock
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = _bind(self._pub, config.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = _bind(self._replay, config.replay_endpoint)
        self._topic = config.topic.encode()
        self._pending: list[KvEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._replay_task: asyncio.Task[None] | None = None

    # -------------------------------------------------------------- BlockEventSink (engine thread)

    def stored(self, content: BlockContent, start: int, stop: int) -> None:
        block_tokens = getattr(content, "block_tokens", None)  # GeneratedBlocks knows its tokens
        tokens: tuple[int, ...] = tuple(block_tokens(start, stop)) if block_tokens is not None else ()
        self._pending.append(
            BlockStored(
                block_hashes=tuple(content.block_hashes(start, stop)),
                parent_block_hash=content.block_hash(start - 1) if start else None,
                token_ids=tokens,
                block_size=self._block_size,
                # As vLLM 0.32 writes them (seen in tests/conformance/test_kv_events.py): one (empty)
                # extra-keys entry per block, the group, and the kind of its KV cache spec.
                extra={
                    "extra_keys": [None] * (stop - start),
                    **_GROUP,
                    "kv_cache_spec_kind": "full_attention",
                },
            )
        )

    def removed(self, hashes: Sequence[int]) -> None:
        self._pending.extend(BlockRemoved((h,), extra=_GROUP) for h in hashes)

    def cleared(self) -> None:
        self._pending.append(AllBlocksCleared())

    # -------------------------------------------------------------- publishing

    def flush(self) -> None:
        """Send the events collected since the last flush as one batch (nothing when none)."""
        if not self._pending:
            return
        batch = EventBatch(self._clock(), tuple(self._pending), 0)
        self._pending = []
        payload = encode_batch(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        with contextlib.suppress(zmq.Again):  # above the high-water mark ZMQ drops, as vLLM's does
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)

    def start(self) -> None:
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                _log.warning("kv events: invalid replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart((client, b"", self._topic, encode_seq(seq), payload))
            await replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoint": self.endpoint}
        if self.replay_endpoint is not None:
            out["replay_endpoint"] = self.replay_endpoint
        return out


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    """Bind like vLLM (wildcards and ipc/inproc); returns the endpoint a subscriber connects to
    (``tcp://*:0`` gets a free port, reported as 127.0.0.1:PORT)."""
    sock.bind(endpoint)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if bound.startswith("tcp://0.0.0.0:"):
        return "tcp://127.0.0.1:" + bound.rpartition(":")[2]
    return bound

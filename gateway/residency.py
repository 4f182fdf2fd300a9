"""Which KV blocks each worker holds, from the workers' own KV cache events (pure core).

The workers publish vLLM's KV events (docs/vllm-protocol.md 10; ppd/kv_events.py); the subscriber
edge (gateway/kv_subscriber.py) feeds every batch here with its sequence number. Rules:

1. Per worker, a set of resident block hashes (the 64-bit integers the events carry) with a fixed
   budget: past ``max_blocks`` the oldest stored block is forgotten (so residency is under-, never
   over-estimated). ``BlockStored`` adds, ``BlockRemoved`` drops, ``AllBlocksCleared`` empties.
   Only the GPU tier (``medium`` "GPU" or unset) counts.
2. A worker is *synced* while its batches arrived 0, 1, 2, ... with no gap. A gap, a batch that
   cannot be decoded, a lost connection, or a first batch other than 0 make it unsynced: the set is
   dropped and :meth:`Residency.resident_blocks` answers None, so the caller falls back to today's
   belief (the session's KV is on its decode worker). It is synced again by a full resync (the
   batches from 0 on without a gap, from the publisher's replay socket; the subscriber streams it
   in with begin_resync / apply_events / end_resync and the worker answers None until the end) or
   when the publisher restarts (a batch with seq 0: a new vLLM process starts with an empty cache).
3. The resident context of a prompt on a worker is the longest prefix of the prompt's block hashes
   (``BlockHasher.chain`` of its token ids) that the worker holds.
4. Workers come and go: the static ones from the settings, the ones registered through the admin API
   that name their publisher are tracked (``track``: unsynced, empty, until their stream syncs) and
   forgotten when they leave (``untrack``); the edge that follows the streams is ``KvStreams``.
5. A prompt can also be remembered by its *marks* (``prefix_marks``): the chain's hash after 1, 2, 4,
   8, ... blocks and after its last block, at most ``MAX_MARKS`` of them, a few hundred bytes however
   long the prompt. Each mark's hash names the whole prefix before it (a block hash covers its
   parent's), so the resident prefix by marks (``resident_by_marks``) is the longest marked prefix
   whose marks up to it the worker all holds: rule 3's answer rounded down to a mark. A session keeps
   the marks of the last prompt a P prefilled for it, from P's own answer (gateway/core.py), so a
   later turn is placed without asking a worker for its token ids.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from gateway.openings import Marks, Openings
from ppd.kv_events import (
    AllBlocksCleared,
    BlockHasher,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    external_hash,
)

__all__ = [
    "MAX_MARKS",
    "Applied",
    "KvStreams",
    "KvTracking",
    "Residency",
    "WorkerResidency",
    "marks_from_text",
    "marks_text",
    "prefix_marks",
]

#: Rule 5: the most marks a prompt gets (2^62 blocks before the last one would need more).
MAX_MARKS = 64
_DECIMAL = re.compile(r"[0-9]{1,20}")


def marks_text(marks: Marks) -> str:
    """Rule 5's marks as a session keeps them: ``blocks:hash`` pairs, comma-separated (one string of a
    few hundred bytes, where a tuple of pairs would take over a kilobyte per session)."""
    return ",".join(f"{blocks}:{h}" for blocks, h in marks)


def marks_from_text(text: str) -> Marks:
    """``marks_text``'s inverse; ValueError unless it is at most ``MAX_MARKS`` pairs of increasing
    block counts, each with a 64-bit block hash."""
    if not text:
        return ()
    marks: list[tuple[int, int]] = []
    for pair in text.split(",", MAX_MARKS):
        blocks_text, sep, hash_text = pair.partition(":")
        if not sep or not _DECIMAL.fullmatch(blocks_text) or not _DECIMAL.fullmatch(hash_text.lstrip("-")):
            raise ValueError(f"not a blocks:hash pair: {pair[:40]!r}")
        blocks, h = int(blocks_text), int(hash_text)
        if blocks <= (marks[-1][0] if marks else 0) or not -(2**63) <= h < 2**64:
            raise ValueError("block counts must increase, each hash fit 64 bits")
        marks.append((blocks, h))
    if len(marks) > MAX_MARKS:
        raise ValueError(f"more than {MAX_MARKS} marks")
    return tuple(marks)


def prefix_marks(chain: Sequence[int]) -> Marks:
    """Rule 5: the marks of a prompt whose block hashes are ``chain`` (empty under one block)."""
    marks: list[tuple[int, int]] = []
    blocks = 1
    while blocks < len(chain):
        marks.append((blocks, chain[blocks - 1]))
        blocks *= 2
    if chain:
        marks.append((len(chain), chain[-1]))
    return tuple(marks[-MAX_MARKS:])


class Applied(Enum):
    OK = "ok"  # applied in sequence
    DUPLICATE = "duplicate"  # already applied (a replay overlapping the live stream): ignored
    RESTART = "restart"  # seq 0 after others: the publisher restarted; state reset, synced
    GAP = "gap"  # a batch is missing: unsynced until a full resync
    UNSYNCED = "unsynced"  # ignored while waiting for a full resync


@dataclass(slots=True)
class WorkerResidency:
    blocks: OrderedDict[int, None]
    next_seq: int | None = None  # None: nothing received yet
    synced: bool = False
    dropped: int = 0  # blocks forgotten to stay within the budget


def _key(h: int | bytes) -> int:
    return h if isinstance(h, int) else external_hash(h)


class Residency:
    """Resident block hashes of the tracked workers (rule 1-3 above)."""

    def __init__(self, workers: Iterable[str], *, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self._max = max_blocks
        self._w: dict[str, WorkerResidency] = {w: WorkerResidency(OrderedDict()) for w in workers}

    @property
    def workers(self) -> list[str]:
        return list(self._w)

    def track(self, worker: str) -> None:
        """Rule 4: a worker joins (unsynced, nothing known); one already tracked is left as it is."""
        if worker not in self._w:
            self._w[worker] = WorkerResidency(OrderedDict())

    def untrack(self, worker: str) -> None:
        """Rule 4: a worker left; its index is dropped (answers None from now on)."""
        self._w.pop(worker, None)

    def state(self, worker: str) -> WorkerResidency:
        return self._w[worker]

    def tracked_blocks(self, worker: str) -> int:
        return len(self._w[worker].blocks)

    def synced(self, worker: str) -> bool:
        state = self._w.get(worker)
        return state is not None and state.synced

    # ------------------------------------------------------------------ the event stream

    def apply(self, worker: str, seq: int, batch: EventBatch) -> Applied:
        """One batch of the live stream (rule 2 decides whether it is applied)."""
        applied = self.admit(worker, seq)
        if applied in (Applied.OK, Applied.RESTART):
            self.apply_events(worker, batch.events)
        return applied

    def admit(self, worker: str, seq: int) -> Applied:
        """The sequence bookkeeping of :meth:`apply` alone: on OK or RESTART the caller applies the
        batch's events next with :meth:`apply_events` (the subscriber does it in slices)."""
        st = self._w[worker]
        if seq == 0 and st.next_seq not in (None, 0):
            self._reset(st)
            st.next_seq, st.synced = 1, True
            return Applied.RESTART
        if st.next_seq is None:
            if seq != 0:  # joined late: the batches before were missed
                self.lost(worker)
                return Applied.GAP
            st.next_seq, st.synced = 0, True
        if not st.synced:
            return Applied.UNSYNCED
        assert st.next_seq is not None
        if seq < st.next_seq:
            return Applied.DUPLICATE
        if seq > st.next_seq:
            self.lost(worker)
            return Applied.GAP
        st.next_seq = seq + 1
        return Applied.OK

    def lost(self, worker: str) -> None:
        """The stream can no longer be trusted (gap, bad message, reconnect): unsynced, state dropped."""
        st = self._w[worker]
        self._reset(st)
        st.synced = False
        st.next_seq = -1  # neither None (first contact) nor a valid next number

    def resync(self, worker: str, batches: Sequence[tuple[int, EventBatch]]) -> bool:
        """Rebuild from the publisher's replay of everything from seq 0; False (still unsynced) when
        the replay does not start at 0 or has a gap (its buffer no longer holds the start). Live
        batches the replay already covered are then ignored as duplicates."""
        if any(seq != i for i, (seq, _) in enumerate(batches)):
            return False
        self.begin_resync(worker)
        for _, batch in batches:
            self.apply_events(worker, batch.events)
        self.end_resync(worker, len(batches))
        return True

    def begin_resync(self, worker: str) -> None:
        """A full resync streamed in place (the subscriber applies the replay as it arrives): the
        worker is unsynced with an empty set; the caller then feeds the replay's batches 0, 1, 2, ...
        to :meth:`apply_events` and calls :meth:`end_resync`, or :meth:`lost` to give up. Nothing is
        answered for the worker meanwhile."""
        self.lost(worker)

    def end_resync(self, worker: str, next_seq: int) -> None:
        """The replay delivered batches 0 .. next_seq - 1 without a gap: synced. An empty replay
        means nothing was ever published (the buffer only ever drops its oldest)."""
        st = self._w[worker]
        st.next_seq, st.synced = next_seq, True

    def _reset(self, st: WorkerResidency) -> None:
        st.blocks.clear()

    def apply_events(self, worker: str, events: Sequence[KvEvent]) -> None:
        """Events of a batch :meth:`admit` accepted (or of a replay, between begin/end_resync)."""
        st = self._w[worker]
        blocks = st.blocks
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium not in (None, "GPU"):
                    continue
                for h in event.block_hashes:
                    k = _key(h)
                    blocks[k] = None
                    blocks.move_to_end(k)
                while len(blocks) > self._max:
                    blocks.popitem(last=False)
                    st.dropped += 1
            elif isinstance(event, BlockRemoved):
                if event.medium not in (None, "GPU"):
                    continue
                for h in event.block_hashes:
                    blocks.pop(_key(h), None)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    # ------------------------------------------------------------------ the question

    def resident_blocks(self, worker: str, hashes: Sequence[int]) -> int | None:
        """How many leading blocks of ``hashes`` the worker holds; None when it is not tracked or
        not synced (then nothing is known)."""
        st = self._w.get(worker)
        if st is None or not st.synced:
            return None
        blocks = st.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def resident_by_marks(self, worker: str, marks: Marks) -> int | None:
        """Rule 5: the leading blocks of a prompt known by its ``marks`` that the worker holds, to the
        mark; None when it is not tracked or not synced."""
        st = self._w.get(worker)
        if st is None or not st.synced:
            return None
        n = 0
        for blocks, h in marks:
            if h not in st.blocks:
                break
            n = blocks
        return n


class KvStreams(Protocol):
    """Rule 4's edge: follows a worker's KV event publisher (gateway/kv_subscriber.py)."""

    def follow(self, worker: str, endpoint: str, replay_endpoint: str | None) -> None:
        """Track ``worker`` from ``endpoint`` (and resync from ``replay_endpoint``); the same
        endpoints again (a heartbeat) change nothing, other ones replace the old stream."""
        ...

    def unfollow(self, worker: str) -> None:
        """Stop following ``worker`` (gone from the pool) and forget its residency; a static or
        unknown worker is left alone."""
        ...


@dataclass(frozen=True, slots=True)
class KvTracking:
    """What the request path needs: the residency and the workers' block hash function; the streams'
    edge, for workers that register (None when registered workers are not tracked)."""

    residency: Residency
    hasher: BlockHasher
    streams: KvStreams | None = None
    # What Turn 1s opening with a known first message hold in common (gateway/openings.py); None: off.
    openings: Openings | None = None

    def resident_tokens(self, worker: str, token_ids: Sequence[int]) -> int | None:
        """Tokens of the prompt ``token_ids`` resident on ``worker`` (whole blocks); None if unknown."""
        if not self.residency.synced(worker):
            return None
        blocks = self.residency.resident_blocks(worker, self.hasher.chain(token_ids))
        return None if blocks is None else blocks * self.hasher.block_size

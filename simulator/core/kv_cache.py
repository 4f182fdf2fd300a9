"""KV blocks: chained block hashes and the block pool with its prefix cache (vLLM V1 semantics).

A request's token sequence (prompt, then output) is cut into ``block_size``-token blocks; block *i*
is identified by a hash that covers blocks 0..i (a chain), so equal hashes mean equal prefixes.
Two kinds of content provide these hashes:

- :class:`TokenBlocks`: real token ids (the HTTP workers); hash(i) = hash((hash(i-1), tokens of i)).
- :class:`StreamBlocks`: a synthetic conversation stream (the cluster simulation): position *p* of
  stream *s* is the same token in every turn, so hash(i) is just a function of (s, i). Building it
  costs nothing, which is what makes the virtual-time sweeps fast.

:class:`BlockPool` holds ``num_blocks`` blocks. Rules:
1. A block is *private* (held by one request, not hashed), *cached* (hashed, ref count ≥ 0) or *free*.
2. Cached blocks with ref count 0 are free too, and sit in an LRU queue; allocation takes plain free
   blocks first, then evicts from the LRU head (the least recently released; within one release, the
   last block of the list first).
3. ``num_free`` counts plain free plus evictable blocks; usage = 1 − num_free / num_blocks (vLLM's
   ``kv_cache_usage_perc``).
4. A hash is cached at most once; a request that computed a duplicate block keeps it private.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import deque
from collections.abc import Sequence
from typing import Protocol, cast

__all__ = ["BlockContent", "BlockEventSink", "BlockPool", "PrefixedBlocks", "StreamBlocks", "TokenBlocks"]

_is_cached = functools.partial(operator.is_not, None)  # on ref-dict .get results: the hash is cached


class BlockContent(Protocol):
    """Gives the chained hash of full block ``index`` of a request's sequence (prompt then output)."""

    def block_hash(self, index: int) -> int: ...

    def block_hashes(self, start: int, stop: int) -> Sequence[int]:
        """Hashes of blocks ``start`` to ``stop − 1`` (bulk form of ``block_hash``)."""
        ...


class BlockEventSink(Protocol):
    """Told what enters and leaves the prefix cache (vLLM's KV events; simulator/server/kv_events.py).

    ``stored`` is called by the engine with the request's content and the block range it cached;
    ``removed`` with the hashes the pool evicted; ``cleared`` after a prefix-cache reset.
    """

    def stored(self, content: BlockContent, start: int, stop: int) -> None: ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class TokenBlocks:
    """Chained hashes over real token ids (prompt followed by the planned output), computed lazily."""

    __slots__ = ("_block_size", "_hashes", "_tokens")

    def __init__(self, token_ids: Sequence[int], block_size: int = 16) -> None:
        self._tokens = tuple(token_ids)
        self._block_size = block_size
        self._hashes: list[int] = []

    def block_hash(self, index: int) -> int:
        hashes = self._hashes
        bs = self._block_size
        while len(hashes) <= index:
            i = len(hashes)
            if (i + 1) * bs > len(self._tokens):
                # Beyond the known tokens: a hash no other sequence can produce.
                return hash(("unknown", id(self), index))
            parent = hashes[i - 1] if i else 0
            hashes.append(hash((parent, self._tokens[i * bs : (i + 1) * bs])))
        return hashes[index]

    def block_hashes(self, start: int, stop: int) -> Sequence[int]:
        return [self.block_hash(i) for i in range(start, stop)]


class StreamBlocks:
    """Block *i* of synthetic stream ``stream_id``; every turn of one conversation shares the stream.

    Conversations use ids 0, 1, 2, ...; the cluster gives shared system prompts -2, -3, ... (their
    hashes are positive, a conversation's negative, so the two never meet).
    """

    __slots__ = ("_base",)

    def __init__(self, stream_id: int) -> None:
        self._base = -((stream_id + 1) << 32)

    def block_hash(self, index: int) -> int:
        return self._base - index

    def block_hashes(self, start: int, stop: int) -> Sequence[int]:
        return range(self._base - start, self._base - stop, -1)


class PrefixedBlocks:
    """A shared prefix of ``n_prefix_blocks`` blocks, then content of this request only."""

    __slots__ = ("_n", "_own", "_prefix")

    def __init__(self, prefix: BlockContent, n_prefix_blocks: int, own: BlockContent) -> None:
        self._prefix = prefix
        self._n = n_prefix_blocks
        self._own = own

    def block_hash(self, index: int) -> int:
        if index < self._n:
            return self._prefix.block_hash(index)
        return self._own.block_hash(index)

    def block_hashes(self, start: int, stop: int) -> Sequence[int]:
        n = self._n
        if stop <= n:
            return self._prefix.block_hashes(start, stop)
        if start >= n:
            return self._own.block_hashes(start, stop)
        return [*self._prefix.block_hashes(start, n), *self._own.block_hashes(n, stop)]


class BlockPool:
    """Counts blocks and owns the prefix cache (hash -> ref count) with its LRU of evictable blocks.

    Representation (one dict pass per release instead of a linked list per block): ``_ref`` maps a
    cached hash to its ref count when held, or to ``-stamp`` while evictable, where ``stamp`` numbers
    the ``release`` call that made it evictable. The LRU order is the queue of released batches, each
    in release order; an entry ``(h, stamp)`` of the queue is live iff ``_ref[h] == -stamp`` (a block
    acquired again, or released again later, leaves a stale entry behind, skipped when evicting).
    """

    __slots__ = (
        "_batches",
        "_free",
        "_head",
        "_idle",
        "_queued",
        "_ref",
        "_shared",
        "_stamp",
        "evictions",
        "num_blocks",
        "sink",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self._free = num_blocks
        self._ref: dict[int, int] = {}
        self._idle = 0  # cached blocks with ref count 0 (evictable)
        self._shared = 0  # Σ (ref count − 1) over held blocks: 0 means every held block has one holder
        self._batches: deque[tuple[int, Sequence[int]]] = deque()  # (stamp, hashes in release order)
        self._head = 0  # position reached in the first batch
        self._queued = 0  # entries in the batches from _head on, live or stale
        self._stamp = 0
        self.evictions = 0
        self.sink: BlockEventSink | None = None  # KV events (off: the virtual-time cluster, the sweeps)

    @property
    def num_free(self) -> int:
        return self._free + self._idle

    @property
    def num_cached(self) -> int:
        return len(self._ref)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block_hash: int) -> int:
        count = self._ref.get(block_hash, 0)
        return count if count > 0 else 0

    def match(self, content: BlockContent, max_blocks: int) -> int:
        """How many leading blocks of ``content`` are cached (at most ``max_blocks``); no side effect."""
        if max_blocks <= 0:
            return 0
        hashes = content.block_hashes(0, max_blocks)
        return len(list(itertools.takewhile(self._ref.__contains__, hashes)))

    def acquire(self, content: BlockContent, n_blocks: int) -> list[int]:
        """Take a reference on the first ``n_blocks`` cached blocks (a prefix hit); returns their hashes."""
        out = list(content.block_hashes(0, n_blocks))
        if out:
            self._take(out, list(map(self._ref.__getitem__, out)))
        return out

    def acquire_prefix(self, content: BlockContent, max_blocks: int) -> list[int]:
        """``acquire`` of the ``match`` blocks (the leading cached ones, at most ``max_blocks``), one pass."""
        if max_blocks <= 0:
            return []
        hashes = content.block_hashes(0, max_blocks)
        # The leading non-None ref counts: those blocks are cached.
        counts = cast("list[int]", list(itertools.takewhile(_is_cached, map(self._ref.get, hashes))))
        if not counts:
            return []
        out = list(hashes[: len(counts)])
        self._take(out, counts)
        return out

    def _take(self, out: list[int], counts: list[int]) -> None:
        ref = self._ref
        if max(counts) < 0:  # the usual case: an idle cached prefix
            ref.update(dict.fromkeys(out, 1))
            self._idle -= len(out)
            return
        for h, count in zip(out, counts, strict=True):
            if count < 0:
                ref[h] = 1
                self._idle -= 1
            else:
                ref[h] = count + 1
                self._shared += 1

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= self._free + self._idle

    def allocate(self, n_blocks: int) -> bool:
        """Take ``n_blocks`` private blocks, evicting LRU cached ones when needed; False if short."""
        if n_blocks <= self._free:
            self._free -= n_blocks
            return True
        if n_blocks > self._free + self._idle:
            return False
        need = n_blocks - self._free
        self._free = 0
        self._evict(need)
        return True

    def _evict(self, need: int) -> None:
        """Drop the ``need`` least recently released evictable blocks."""
        ref, batches = self._ref, self._batches
        self._idle -= need
        self.evictions += need
        pos = self._head
        evicted: list[int] | None = [] if self.sink is not None else None
        while need:
            stamp, hashes = batches[0]
            live = -stamp
            n = len(hashes)
            while pos < n and need:
                h = hashes[pos]
                pos += 1
                if ref.get(h) == live:
                    del ref[h]
                    need -= 1
                    if evicted is not None:
                        evicted.append(h)
            self._queued -= pos - self._head
            if pos == n:
                batches.popleft()
                pos = 0
            self._head = pos
        if evicted is not None and self.sink is not None:
            self.sink.removed(evicted)

    def release_private(self, n_blocks: int) -> None:
        self._free += n_blocks

    def register(self, block_hash: int) -> bool:
        """Turn one of the caller's private blocks into cached block ``block_hash`` (ref 1), if not cached."""
        if block_hash in self._ref:
            return False
        self._ref[block_hash] = 1
        return True

    def register_many(self, hashes: Sequence[int], limit: int) -> list[int]:
        """``register`` for each hash not cached yet, at most ``limit`` of them; returns those registered."""
        ref = self._ref
        new = list(hashes) if ref.keys().isdisjoint(hashes) else [h for h in hashes if h not in ref]
        if len(new) > limit:
            new = new[:limit]
        ref.update(dict.fromkeys(new, 1))
        return new

    def release(self, hashes: Sequence[int]) -> None:
        """Drop one reference on each hash, in reverse so a sequence's tail is evicted before its head."""
        if not hashes:
            return
        ref = self._ref
        self._stamp += 1
        stamp = self._stamp
        rev = hashes[::-1]
        if not self._shared:  # the usual case: no block has two holders, so the caller is the only one
            ref.update(dict.fromkeys(rev, -stamp))
            self._idle += len(rev)
        else:
            for h in rev:
                count = ref[h] - 1
                if count == 0:
                    ref[h] = -stamp
                    self._idle += 1
                else:
                    ref[h] = count
                    self._shared -= 1
        self._batches.append((stamp, rev))
        self._queued += len(rev)
        if self._queued > 2 * self._idle + 4096:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale entries of the LRU queue (amortised: it has at least doubled since the last)."""
        ref = self._ref
        batches: deque[tuple[int, Sequence[int]]] = deque()
        head = self._head
        for stamp, hashes in self._batches:
            live = -stamp
            kept = [h for h in itertools.islice(hashes, head, None) if ref.get(h) == live]
            head = 0
            if kept:
                batches.append((stamp, kept))
        self._batches = batches
        self._head = 0
        self._queued = self._idle

    def reset_prefix_cache(self) -> bool:
        """Drop every evictable cached block (vLLM's /reset_prefix_cache); False if some are still in use."""
        if self._idle != len(self._ref):
            return False
        self._free += self._idle
        self._idle = 0
        self._ref.clear()
        self._batches.clear()
        self._head = 0
        self._queued = 0
        if self.sink is not None:
            self.sink.cleared()
        return True

"""The shared session store of several gateway replicas, on Redis (`[sessions] redis_url`).

Rule 1 (atomic): every operation is one Lua script over one or several entries (`get_many`: a chat
request's candidate keys, session_lookup.py rule 2; `put_many`: the keys of one turn's state), so
Redis runs it whole and alone, in one round trip: a read renews each found entry's TTL and its place
in the LRU index; a write sets the value under each key with its TTL, indexes them and trims the
store to `max_entries` in the same step. No replica ever sees a value
without its TTL, an index without its entry, or a store over its bound. Two replicas finishing a turn
of one conversation at once: the later write wins, as within one replica.
Rule 2 (bounded): each entry expires `ttl_s` after its last read or write (PX); a sorted set
`<prefix>index` orders the entries by last use (Redis's own clock, the same for every replica) and
the write that takes the store over `max_entries` deletes the least recently used. The sweeper
(`expire`) drops index members whose entry expired.
Rule 3 (degraded, never a client error): when a call fails (Redis down, unreachable, slower than
`redis_timeout_s`, refusing writes), the store switches to this replica's own memory (an
InMemorySessionStore with the same bounds), says so in one WARNING line and the gauge
`ppd_gateway_session_store_degraded` = 1, and stops calling Redis on the request path. `watch()`
tries a real write every `redis_retry_s`; when one succeeds, the sessions learnt meanwhile are
written back, one INFO line says so, and the gauge returns to 0. Conversations continue throughout;
only the sharing pauses (a turn landing on another replica meanwhile starts over through P/D).
Rule 4 (generic entries): values are `session_codec.session_codec()` bytes; an entry that does not
decode (another version, corruption, a value out of bounds: session_codec.py rule 3) counts as a miss,
counted by reason and logged at most once a minute (the turn proceeds as a new conversation, as if the
session had expired).
Rule 5 (bounded reads): the read script checks each key's type and size inside Redis and returns no
value of another type or over `MAX_ENTRY_BYTES` (just its size), so a huge entry never crosses the
network or stalls a read past `redis_timeout_s`; it is a miss like any unreadable entry. One read
returns at most 2 x `sessions.prefix_candidates` values. A session
whose own entry would exceed the bound is not written (counted, logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Final

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.limits import LimitSettings
from gateway.metrics import GatewayMetrics
from gateway.session_codec import Bounds, CodecError, session_codec
from gateway.sessions import InMemorySessionStore, Session
from gateway.settings import SessionSettings
from gateway.types import Clock
from ppd.rate_limited_log import RateLimitedLog

__all__ = ["MAX_ENTRY_BYTES", "RedisSessionStore"]

log = logging.getLogger(__name__)

#: The largest entry a read takes from Redis (rule 5); a session's is a few hundred bytes.
MAX_ENTRY_BYTES: Final = 1 << 20
# Index scores are Redis's TIME in milliseconds with a microsecond fraction, built as a string (Lua
# would print a number with 14 digits, dropping the fraction): uses within one millisecond keep their
# order. The sweep's cutoff is in the same milliseconds.
# KEYS: entries..., index. ARGV: ttl_ms, max_bytes. For each entry: the value, its TTL renewed and its
# index score set to now; nil (false) when there is none; -1 for a key of another type; the size of a
# value over max_bytes.
_GET: Final = """
local index = KEYS[#KEYS]
local t = redis.call('TIME')
local now = t[1] .. string.format('%07.3f', t[2] / 1000)
local out = {}
for i = 1, #KEYS - 1 do
  local key = KEYS[i]
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    out[i] = false
  elseif kind ~= 'string' then
    out[i] = -1
  else
    local size = redis.call('STRLEN', key)
    if size > tonumber(ARGV[2]) then
      out[i] = size
    else
      out[i] = redis.call('GET', key)
      redis.call('PEXPIRE', key, ARGV[1])
      redis.call('ZADD', index, now, key)
    end
  end
end
return out
"""
# KEYS: entries..., index. ARGV: value, ttl_ms, max_entries. The value under every entry; returns the
# entries held after the write.
_PUT: Final = """
local index = KEYS[#KEYS]
local t = redis.call('TIME')
local now = t[1] .. string.format('%07.3f', t[2] / 1000)
for i = 1, #KEYS - 1 do
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
  redis.call('ZADD', index, now, KEYS[i])
end
local held = redis.call('ZCARD', index)
local over = held - tonumber(ARGV[3])
if over > 0 then
  local oldest = redis.call('ZPOPMIN', index, over)
  for i = 1, #oldest, 2 do
    redis.call('DEL', oldest[i])
  end
  held = held - over
end
return held
"""
# KEYS: index. ARGV: ttl_ms. Drops the members whose entry expired; returns (dropped, held).
_EXPIRE: Final = """
local t = redis.call('TIME')
local cutoff = t[1] * 1000 + math.floor(t[2] / 1000) - tonumber(ARGV[1])
local dropped = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', cutoff)
return {dropped, redis.call('ZCARD', KEYS[1])}
"""
_BAD_ENTRY_LOG_S: Final = 60.0
_ID_LENGTH: Final = LimitSettings().max_id_length
_FAILURES: Final = (RedisError, OSError)
_WRITE_BACK_ROUNDS: Final = 3


class RedisSessionStore:
    """A SessionStore (sessions.py) on Redis, shared by every replica that names the same Redis and
    prefix; falls back to local memory while Redis fails (module docstring)."""

    def __init__(
        self,
        client: aioredis.Redis,
        settings: SessionSettings,
        metrics: GatewayMetrics,
        *,
        clock: Clock,
        max_id_length: int = _ID_LENGTH,
    ) -> None:
        self._redis = client
        self._s = settings
        self._metrics = metrics
        self._clock = clock
        self._ttl_ms = max(1, round(settings.ttl_s * 1000))
        self._index = settings.redis_prefix + "index"
        self._codec = session_codec(max_id_length=max_id_length, bounds=Bounds(max_bytes=MAX_ENTRY_BYTES))
        self._get = client.register_script(_GET)
        self._put = client.register_script(_PUT)
        self._expire = client.register_script(_EXPIRE)
        self._local = self._new_local()
        self._held = 0
        self.degraded = False
        self._bad_log = RateLimitedLog(log, interval_s=_BAD_ENTRY_LOG_S, clock=clock)
        metrics.session_store_degraded.set(0)

    @classmethod
    def connect(
        cls,
        settings: SessionSettings,
        metrics: GatewayMetrics,
        *,
        clock: Clock,
        max_id_length: int = _ID_LENGTH,
    ) -> RedisSessionStore:
        """A store on `settings.redis_url`; connects lazily (no call is made here)."""
        client = aioredis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            # No retries inside the client: a failed call goes to local memory at once (Rule 3).
            retry=Retry(NoBackoff(), 0),
        )
        return cls(client, settings, metrics, clock=clock, max_id_length=max_id_length)

    def _new_local(self) -> InMemorySessionStore:
        return InMemorySessionStore(ttl_s=self._s.ttl_s, max_entries=self._s.max_entries, clock=self._clock)

    def _key(self, key: str) -> str:
        return self._s.redis_prefix + key

    def __len__(self) -> int:
        return len(self._local) if self.degraded else self._held

    async def get(self, key: str) -> Session | None:
        return (await self.get_many((key,)))[0]

    async def get_many(self, keys: Sequence[str]) -> list[Session | None]:
        raws: list[bytes | int | None] = [None] * len(keys)
        if keys and not self.degraded:
            try:
                raws = await self._get(
                    keys=[*map(self._key, keys), self._index], args=[self._ttl_ms, MAX_ENTRY_BYTES]
                )
            except _FAILURES as exc:
                self._degrade(exc)
        found: list[Session | None] = []
        for key, raw in zip(keys, raws, strict=True):
            session = self._decode(key, raw) if raw is not None else None
            # Degraded, or a miss: what this replica learnt while Redis was away (empty otherwise).
            found.append(session if session is not None else self._local.get_now(key))
        return found

    async def put(self, key: str, session: Session) -> None:
        await self.put_many((key,), session)

    async def put_many(self, keys: Sequence[str], session: Session) -> None:
        if not keys:
            return
        if not self.degraded:
            try:
                self._held = int(await self._write(keys, session))
                return
            except _FAILURES as exc:
                self._degrade(exc)
        for key in keys:
            self._local.put_now(key, session)

    async def expire(self) -> int:
        dropped = self._local.expire_now()
        if self.degraded:
            return dropped
        try:
            gone, held = await self._expire(keys=[self._index], args=[self._ttl_ms])
        except _FAILURES as exc:
            self._degrade(exc)
            return dropped
        self._held = int(held)
        return dropped + int(gone)

    async def _write(self, keys: Sequence[str], session: Session) -> int:
        value = self._codec.encode(session)
        if len(value) > MAX_ENTRY_BYTES:  # rule 5: no replica could read it back
            self._metrics.session_store_bad_entries.labels("too_large").inc()
            self._bad_log.log(
                "session store: the entry of session %s is %d bytes, over the limit of %d: not written",
                session.id, len(value), MAX_ENTRY_BYTES,
            )  # fmt: skip
            return self._held
        return int(
            await self._put(
                keys=[*map(self._key, keys), self._index], args=[value, self._ttl_ms, self._s.max_entries]
            )
        )

    def _decode(self, key: str, raw: bytes | int) -> Session | None:
        """The entry's session; None (counted, logged) for one of another type (-1), over the size
        bound (its size: the script did not send it) or that does not decode."""
        try:
            if isinstance(raw, int):
                if raw < 0:
                    raise CodecError("the key holds another Redis type", reason="wrong_type")
                raise CodecError(f"{raw} bytes, over the limit of {MAX_ENTRY_BYTES}", reason="too_large")
            return self._codec.decode(raw)
        except CodecError as exc:
            self._bad(key, exc)
            return None

    def _bad(self, key: str, exc: CodecError) -> None:
        self._metrics.session_store_errors.labels("bad_entry").inc()
        self._metrics.session_store_bad_entries.labels(exc.reason).inc()
        self._bad_log.log(
            "session store: an entry in Redis could not be read and counts as missing (%s: %s: %s)",
            key, exc.reason, exc,
        )  # fmt: skip

    def _degrade(self, exc: BaseException) -> None:
        self._metrics.session_store_errors.labels(_cause(exc)).inc()
        if self.degraded:
            return
        self.degraded = True
        self._metrics.session_store_degraded.set(1)
        log.warning(
            "session store: Redis failed (%s: %s); keeping sessions in this replica's memory until it "
            "answers again (retry every %g s)",
            type(exc).__name__, exc, self._s.redis_retry_s,
        )  # fmt: skip

    async def probe(self) -> bool:
        """One recovery attempt while degraded: a real write (so a Redis that refuses writes stays
        degraded), then the sessions learnt meanwhile written back (requests keep writing to local
        memory until then, so a round repeats while they add more). True when sharing resumed."""
        if not self.degraded:
            return True
        written = 0
        try:
            await self._redis.set(self._s.redis_prefix + "probe", b"1", px=self._ttl_ms)
            for _ in range(_WRITE_BACK_ROUNDS):
                pending, self._local = self._local, self._new_local()
                try:
                    for key, session in pending.items():
                        self._held = await self._write((key,), session)
                        written += 1
                except _FAILURES:
                    for key, session in pending.items():  # keep what did not go back
                        if self._local.get_now(key) is None:
                            self._local.put_now(key, session)
                    raise
                if not self._local:
                    break
        except _FAILURES as exc:
            log.debug("session store: Redis still failing: %s", exc)
            return False
        self.degraded = False
        self._metrics.session_store_degraded.set(0)
        log.info(
            "session store: Redis answers again; %d session entr%s learnt meanwhile written back, "
            "sharing resumed",
            written, "y" if written == 1 else "ies",
        )  # fmt: skip
        return True

    async def watch(self) -> None:
        """Run for the life of the app: a recovery attempt every `redis_retry_s` while degraded."""
        while True:
            await asyncio.sleep(self._s.redis_retry_s)
            if self.degraded:
                await self.probe()

    async def close(self) -> None:
        await self._redis.aclose()


def _cause(exc: BaseException) -> str:
    """The metric label of a failed call."""
    if isinstance(exc, RedisTimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "unreachable"
    return "error"

"""The shared session store on a real redis-server: shared between replicas, atomic writes with TTL and
a bound, and each failure provoked (Redis killed, hung, refusing writes, a bad entry): never an error
to the caller, one log line each way, the degraded gauge, recovery with write-back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from gateway.metrics import GatewayMetrics
from gateway.redis_sessions import RedisSessionStore
from gateway.sessions import Session
from gateway.settings import SessionSettings, Settings, SettingsError
from tests.support.metrics import sample
from tests.support.polling import eventually
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

LOGGER = "gateway.redis_sessions"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    redis_server = RedisServer.start()
    try:
        yield redis_server
    finally:
        redis_server.close()


def _settings(server: RedisServer, **kw: object) -> SessionSettings:
    base: dict[str, object] = {"redis_url": server.url, "ttl_s": 60.0, "max_entries": 100}
    return dataclasses.replace(SessionSettings(), **{**base, **kw})  # type: ignore[arg-type]


class Replica:
    """One gateway replica's store and its metrics."""

    def __init__(self, settings: SessionSettings) -> None:
        self.metrics = GatewayMetrics()
        self.store = RedisSessionStore.connect(settings, self.metrics, clock=time.monotonic)

    def degraded(self) -> float | None:
        return sample(self.metrics.registry, "ppd_gateway_session_store_degraded")

    def errors(self, cause: str) -> float | None:
        return sample(self.metrics.registry, "ppd_gateway_session_store_errors_total", cause=cause)


@pytest.fixture
async def replicas(server: RedisServer) -> AsyncIterator[list[Replica]]:
    made = [Replica(_settings(server)) for _ in range(3)]
    try:
        yield made
    finally:
        for replica in made:
            await replica.store.close()


@pytest.fixture
async def raw(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(server.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


def _session(name: str, turns: int = 1) -> Session:
    return Session(name, worker="D1", turns=turns, context_tokens=100 * turns, output_lengths=(7,) * turns)


async def test_a_session_written_by_one_replica_is_read_by_the_others(replicas: list[Replica]) -> None:
    a, b, c = (r.store for r in replicas)
    assert await b.get("c:1") is None
    await a.put("c:1", _session("s1"))
    assert await b.get("c:1") == _session("s1")
    await c.put("c:1", _session("s1", turns=2))
    assert await a.get("c:1") == _session("s1", turns=2)
    assert len(c) == 1
    assert all(r.degraded() == 0 for r in replicas)


async def test_entries_carry_the_idle_ttl_renewed_on_every_read(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    replica = Replica(_settings(server, ttl_s=30.0))
    try:
        await replica.store.put("k", _session("s"))
        key = "ppd:sessions:k"
        assert 0 < await raw.pttl(key) <= 30_000
        await raw.pexpire(key, 5_000)  # as if 25 s went by
        assert await replica.store.get("k") is not None
        assert await raw.pttl(key) > 5_000  # the read renewed it
    finally:
        await replica.store.close()


async def test_an_idle_entry_expires_and_the_sweep_drops_it_from_the_index(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    replica = Replica(_settings(server, ttl_s=0.2))
    try:
        await replica.store.put("k", _session("s"))

        async def gone() -> bool:  # looked at from outside: a read through the store would renew it
            return await raw.exists("ppd:sessions:k") == 0

        await eventually(gone, what="the entry to expire")
        assert await replica.store.get("k") is None

        async def swept() -> bool:
            await replica.store.expire()
            return await raw.zcard("ppd:sessions:index") == 0 and len(replica.store) == 0

        await eventually(swept, what="the sweep to drop the index member")
    finally:
        await replica.store.close()


async def test_concurrent_writers_never_take_the_store_over_its_bound(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    """Three replicas write 300 entries at once into a 20-entry store: every write is one script, so
    the index and the entries always agree and the bound always holds."""
    writers = [Replica(_settings(server, max_entries=20)) for _ in range(3)]
    try:
        await asyncio.gather(
            *(
                w.store.put(f"k{i}-{j}", _session(f"s{i}-{j}"))
                for j in range(100)
                for i, w in enumerate(writers)
            )
        )
        index = {str(m) for m in await raw.zrange("ppd:sessions:index", 0, -1)}
        entries = {str(k) for k in await raw.keys("ppd:sessions:k*")}
        assert len(index) == 20
        assert entries == index
        assert all(len(w.store) <= 20 for w in writers)
    finally:
        for w in writers:
            await w.store.close()


async def test_the_least_recently_used_entry_goes_first(server: RedisServer) -> None:
    replica = Replica(_settings(server, max_entries=3))
    try:
        for key in "abc":
            await replica.store.put(key, _session(key))
        await replica.store.get("a")
        await replica.store.put("d", _session("d"))
        assert await replica.store.get("b") is None
        assert [await replica.store.get(k) is not None for k in "acd"] == [True, True, True]
    finally:
        await replica.store.close()


async def test_an_entry_that_does_not_decode_is_a_counted_miss_logged_once(
    replicas: list[Replica], raw: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = replicas[0]
    await raw.set("ppd:sessions:v2", b'{"v": 2, "f": {"id": "x"}}')
    await raw.set("ppd:sessions:junk", b"\xff not json")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await store.store.get("v2") is None
        assert await store.store.get("junk") is None
    assert store.errors("bad_entry") == 2
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1
    assert "could not be read" in lines[0].getMessage()
    assert store.degraded() == 0


async def test_redis_killed_means_local_memory_one_line_each_way_and_write_back(
    server: RedisServer, replicas: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, _ = replicas
    await a.store.put("before", _session("s0"))
    server.kill()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        # No call raises: the first failure switches to local memory, later calls do not touch Redis.
        assert await a.store.get("before") is None
        await a.store.put("during", _session("s1", turns=3))
        assert await a.store.get("during") == _session("s1", turns=3)
        assert await a.store.expire() == 0
        assert a.degraded() == 1
        assert a.errors("unreachable") == 1
        assert await a.store.probe() is False
        assert a.degraded() == 1
        server.restart()  # empty: what the replicas learnt meanwhile is only in their memory
        assert await a.store.probe() is True
    assert a.degraded() == 0
    assert await b.store.get("during") == _session("s1", turns=3)  # written back, shared again
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
    assert len(messages) == 2, messages
    assert messages[0].startswith("session store: Redis failed (ConnectionError")
    assert messages[1].startswith("session store: Redis answers again; 1 session entry learnt meanwhile")


async def test_a_hung_redis_costs_one_timeout_then_local_memory(server: RedisServer) -> None:
    replica = Replica(_settings(server, redis_timeout_s=0.2))
    try:
        await replica.store.put("k", _session("s"))
        server.pause()
        try:
            assert await replica.store.get("k") is None  # waited redis_timeout_s, then local memory
            assert replica.errors("timeout") == 1
            assert replica.degraded() == 1
            await replica.store.put("k", _session("s", turns=2))
            assert await replica.store.get("k") == _session("s", turns=2)
        finally:
            server.resume()

        async def recovered() -> bool:
            return await replica.store.probe()

        await eventually(recovered, what="the store to recover after SIGCONT")
        assert replica.degraded() == 0
        assert await replica.store.get("k") == _session("s", turns=2)
    finally:
        await replica.store.close()


async def test_a_redis_that_refuses_writes_keeps_the_replica_degraded(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    """OOM: reads work but writes fail; the store goes local and a PING alone would not bring it back."""
    replica = Replica(_settings(server))
    try:
        await raw.config_set("maxmemory", 1)  # below what Redis already uses: every write refused
        await replica.store.put("k", _session("s"))
        assert replica.degraded() == 1
        assert replica.errors("error") == 1
        assert await replica.store.get("k") == _session("s")  # from local memory
        assert await replica.store.probe() is False
        await raw.config_set("maxmemory", 0)
        assert await replica.store.probe() is True
        assert await raw.exists("ppd:sessions:k") == 1
    finally:
        await replica.store.close()


def test_settings_name_a_redis_url_or_nothing() -> None:
    s = Settings.from_mapping({"sessions": {"redis_url": "redis://cache:6379/0"}})
    assert s.sessions.redis_url == "redis://cache:6379/0"
    assert Settings().sessions.redis_url == ""  # the in-memory store is the default
    with pytest.raises(SettingsError, match="redis_url"):
        Settings.from_mapping({"sessions": {"redis_url": "http://cache"}})
    with pytest.raises(SettingsError, match="redis_timeout_s"):
        Settings.from_mapping({"sessions": {"redis_url": "unix:///x.sock", "redis_timeout_s": 0}})


async def test_a_write_back_that_fails_half_way_keeps_what_did_not_go_back(
    server: RedisServer, raw: aioredis.Redis
) -> None:
    """Recovery whose probe write passes but whose write-back is refused (an ACL without scripts):
    the sessions learnt meanwhile stay in local memory and the store stays degraded until it works."""
    replica = Replica(_settings(server, redis_timeout_s=0.2))
    try:
        server.pause()
        try:
            await replica.store.put("a", _session("a"))  # times out: degraded, kept locally
        finally:
            server.resume()
        await replica.store.put("b", _session("b"))
        assert replica.degraded() == 1
        await raw.execute_command("ACL", "SETUSER", "default", "-eval", "-evalsha")  # type: ignore[no-untyped-call]
        assert await replica.store.probe() is False
        assert replica.degraded() == 1
        assert await replica.store.get("a") == _session("a")
        assert await replica.store.get("b") == _session("b")
        await raw.execute_command("ACL", "SETUSER", "default", "+eval", "+evalsha")  # type: ignore[no-untyped-call]
        assert await replica.store.probe() is True
        assert await raw.exists("ppd:sessions:a", "ppd:sessions:b") == 2
    finally:
        await replica.store.close()

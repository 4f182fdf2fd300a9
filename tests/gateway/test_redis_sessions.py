"""The shared session store on a real redis-server: shared between replicas, atomic writes with TTL and
a bound, and each failure provoked (Redis killed, hung, refusing writes, a bad entry): never an error
to the caller, one log line each way, the degraded gauge, recovery with write-back."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.metrics import GatewayMetrics
from gateway.redis_sessions import RedisSessionStore
from gateway.sessions import Session, content_key, explicit_key
from gateway.settings import SessionSettings, Settings, SettingsError
from tests.gateway.conftest import MODEL, Reply, Stack, StackFactory
from tests.gateway.fake_decision import FakeDecision
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


# ---------------------------------------------------------------- corrupt entries, through the gateway

_TURN = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "next"},
]
# An entry the request below continues (its history extends what the last turn was sent).
_GOOD: dict[str, Any] = {
    "id": "s1",
    "worker": "D0",
    "turns": 3,
    "context_tokens": 120,
    "output_lengths": [5, 6],
    "history_key": content_key(MODEL, _TURN[:1]),
    "history_messages": 1,
}
_MAX_ENTRY = 1 << 20  # the cap on an entry read from Redis (redis_sessions.MAX_ENTRY_BYTES)


def _entry(**fields: Any) -> bytes:
    return json.dumps({"v": 1, "f": {**_GOOD, **fields}}).encode()


_CORRUPT = {
    "nested": b'{"v": 1, "f": {"id": "s1", "turns": 3, "later": ' + b"[" * 1000 + b"]" * 1000 + b"}}",
    "negative_history_messages": _entry(history_messages=-7),
    "turns_past_int32": _entry(turns=2**70),
    "output_length_past_float": _entry(output_lengths=[10**400]),
    "id_with_crlf": _entry(id="s1\r\nX-Evil: 1"),
    "id_of_a_megabyte": _entry(id="x" * 1_000_000),
    "entry_over_the_cap": _entry(history_key="k" * (2 * _MAX_ENTRY)),
    "decode_kv_params_nested": _entry(decode_kv_params="[" * 1000 + "]" * 1000),
}


_KEY = "ppd:sessions:" + explicit_key("s1")


async def _shared_stack(make_stack: StackFactory, server: RedisServer, decision: FakeDecision) -> Stack:
    """A gateway in ppd mode (so a Turn 2+ builds a RouteRequest) on the shared store."""
    return await make_stack(
        mode="ppd",
        decision={"address": decision.address, "deadline_ms": 2000.0},
        sessions={"redis_url": server.url},
    )


def _bad_entries(stack: Stack) -> float:
    registry = stack.deps.metrics.registry
    counted = [
        sample(registry, "ppd_gateway_session_store_bad_entries_total", reason=r)
        for r in ("too_large", "wrong_type", "not_json", "too_deep", "version", "field")
    ]
    return sum(c or 0.0 for c in counted)


def _a_new_conversation(reply: Reply) -> None:
    assert reply.status == 200, reply.body
    assert reply.headers["X-PPD-Turn"] == "1"
    assert reply.headers["X-PPD-Session-Id"] == "s1"


async def test_the_good_entry_is_continued(
    make_stack: StackFactory, server: RedisServer, raw: aioredis.Redis, decision: FakeDecision
) -> None:
    """The baseline the corrupt entries below are variations of."""
    stack = await _shared_stack(make_stack, server, decision)
    await raw.set(_KEY, _entry())
    reply = await stack.chat(_TURN, headers={"X-Session-ID": "s1"})
    assert (reply.status, reply.headers["X-PPD-Turn"]) == (200, "4")
    assert decision.seen[-1].turn == 4


@pytest.mark.parametrize("name", sorted(_CORRUPT))
async def test_a_corrupt_entry_is_a_lost_session_counted_and_logged_once(
    make_stack: StackFactory,
    server: RedisServer,
    raw: aioredis.Redis,
    decision: FakeDecision,
    caplog: pytest.LogCaptureFixture,
    name: str,
) -> None:
    """Each entry once made the request a 500 (RecursionError, IndexError, an int32 overflow in the
    RouteRequest, a float overflow, a header the client refuses, a read past the timeout)."""
    stack = await _shared_stack(make_stack, server, decision)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            await raw.set(_KEY, _CORRUPT[name])
            _a_new_conversation(await stack.chat(_TURN, headers={"X-Session-ID": "s1"}))
    assert _bad_entries(stack) == 2
    registry = stack.deps.metrics.registry
    assert sample(registry, "ppd_gateway_session_store_errors_total", cause="bad_entry") == 2
    assert sample(registry, "ppd_gateway_session_store_degraded") == 0
    lines = [r for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, [r.getMessage()[:200] for r in lines]
    assert "could not be read and counts as missing" in lines[0].getMessage()
    assert len(lines[0].getMessage()) < 1000  # nothing of the entry echoed at length
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    # The turn wrote a good entry in its place: the next turn continues it.
    written = await raw.get(_KEY)
    assert isinstance(written, str)
    assert json.loads(written)["f"]["turns"] == 1


async def test_an_entry_over_the_cap_never_leaves_redis(
    make_stack: StackFactory, server: RedisServer, raw: aioredis.Redis, decision: FakeDecision
) -> None:
    """A 16 MB entry is refused by its size inside Redis: its bytes are never sent to the gateway."""
    stack = await _shared_stack(make_stack, server, decision)
    await raw.set(_KEY, _entry(history_key="k" * (16 * _MAX_ENTRY)))
    before = int((await raw.info("stats"))["total_net_output_bytes"])
    _a_new_conversation(await stack.chat(_TURN, headers={"X-Session-ID": "s1"}))
    sent = int((await raw.info("stats"))["total_net_output_bytes"]) - before
    assert sent < 64 * 1024, sent
    registry = stack.deps.metrics.registry
    assert sample(registry, "ppd_gateway_session_store_bad_entries_total", reason="too_large") == 1


async def test_a_key_of_another_redis_type_is_a_bad_entry_not_a_redis_failure(
    make_stack: StackFactory, server: RedisServer, raw: aioredis.Redis, decision: FakeDecision
) -> None:
    stack = await _shared_stack(make_stack, server, decision)
    await raw.rpush(_KEY, "not", "a", "string")
    _a_new_conversation(await stack.chat(_TURN, headers={"X-Session-ID": "s1"}))
    registry = stack.deps.metrics.registry
    assert sample(registry, "ppd_gateway_session_store_bad_entries_total", reason="wrong_type") == 1
    assert sample(registry, "ppd_gateway_session_store_degraded") == 0


# ---------------------------------------------------------------- sessions without the answer (issue 25)


async def test_a_chat_lookup_is_one_round_trip_for_every_candidate(replicas: list[Replica]) -> None:
    """The longest stored prefix of an 8-turn history is found with one command to Redis, counted on
    the real client (one EVALSHA carrying every candidate's keys)."""
    from gateway.session_lookup import find_session, remember_turn
    from gateway.sessions import KeyChain

    writer, reader = replicas[0].store, replicas[1].store
    history: list[dict[str, Any]] = [{"role": "user", "content": "q0"}]
    for t in range(1, 9):
        history += [{"role": "assistant", "content": f"r{t}"}, {"role": "user", "content": f"q{t}"}]
    sent = history[:5]  # the state after turn 3, remembered by what it was sent
    after = Session("s1", worker="D1", turns=2).after_turn(
        worker="D1",
        prompt_tokens=5,
        completion_tokens=5,
        history_key=KeyChain(MODEL).extend(sent).key(),
        history_messages=len(sent),
    )
    await remember_turn(writer, after, explicit_id=None)

    async def find() -> Any:
        return await find_session(
            reader, explicit=None, endpoint="chat", model=MODEL, messages=history, new_id=lambda: "new"
        )

    await find()  # the first call loads the script into Redis (a NOSCRIPT round trip, once)
    client = reader._redis
    commands: list[str] = []
    real: Callable[..., Awaitable[Any]] = client.execute_command

    async def counting(*args: Any, **options: Any) -> Any:
        commands.append(str(args[0]))
        return await real(*args, **options)

    client.execute_command = counting  # type: ignore[method-assign]
    match = await find()
    assert commands == ["EVALSHA"]
    assert (match.session_id, match.turn, match.history_end, match.lookup) == ("s1", 4, 6, "prefix")


async def test_replicas_share_a_session_found_without_the_answer_key(
    make_stack: StackFactory, server: RedisServer, raw: aioredis.Redis
) -> None:
    """Turn 1 on one gateway replica, its answer-keyed entry gone (as if the front door never saw the
    answer): the follow-up on the other replica finds the session under what turn 1 was sent."""
    a = await make_stack(mode="local", sessions={"redis_url": server.url})
    b = await make_stack(mode="local", sessions={"redis_url": server.url})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    first = await a.chat(messages)
    messages += [{"role": "assistant", "content": first.text}]
    assert await raw.delete("ppd:sessions:" + content_key(MODEL, messages)) == 1
    second = await b.chat([*messages, {"role": "user", "content": "more"}])
    assert (second.path, second.headers["X-PPD-Turn"]) == ("local", "2")
    assert second.headers["X-PPD-Session-Id"] == first.headers["X-PPD-Session-Id"]
    assert second.headers["X-PPD-Decode-Worker"] == first.headers["X-PPD-Decode-Worker"]
    registry = b.deps.metrics.registry
    assert sample(registry, "ppd_gateway_session_lookups_total", result="exact") == 1

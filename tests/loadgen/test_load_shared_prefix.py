"""The load generator on shared-prefix workloads (loadgen.load rule 7): what is sent, and that a real
simulated worker's prefix cache sees the shared system prompt."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from loadgen.load import LoadSettings, run_load
from loadgen.tokens import llama3_counter
from loadgen.workloads import SharedPrefixWorkload, single_token_words
from tests.simulator.client import metric, post, start_alone
from tests.support.fake_openai import FakeWorker

COUNTER = llama3_counter()
WORDS = single_token_words(COUNTER)
NAME = "shared256_2x3_small_tiny"

pytestmark = pytest.mark.integration


@pytest.fixture
async def fake() -> AsyncIterator[FakeWorker]:
    server = await FakeWorker("fake", "replica").start()
    yield server
    await server.close()


def _settings(url: str, tag: str, **kw: Any) -> LoadSettings:
    return LoadSettings(
        url=url,
        qps=40.0,
        duration_s=0.3,
        run_id="t",
        workload=NAME,
        seed=2,
        mode="pd",
        served_model="m",
        run_tag=tag,
        **kw,
    )


async def _run(server: FakeWorker, tag: str, **kw: Any) -> dict[str, list[dict[str, Any]]]:
    """One run's Turn-1 bodies by conversation id (the X-Session-ID the server was sent)."""
    workload = SharedPrefixWorkload(name=NAME, words=WORDS, seed=2)
    before = len(server.completions())
    result = await run_load(_settings(server.url, tag, **kw), workload)
    assert result.conversations >= 4  # at least two groups of two
    assert all(r.ok for r in result.records)
    bodies: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for seen in server.completions()[before:]:
        bodies[seen.headers["X-Session-ID"]].append(seen.body)
    return bodies


def _group(conversation_id: str) -> int:
    """The group of ``<workload>-s<seed>-<index>-r<tag>``: round-robin over 2 groups of 3."""
    index = int(conversation_id.rsplit("-r", 1)[0].rsplit("-", 1)[1])
    return SharedPrefixWorkload(name=NAME, words=WORDS).spec.group_of(index)


async def test_a_group_sends_one_system_prompt_per_run_and_runs_never_share_it(fake: FakeWorker) -> None:
    runs = {tag: await _run(fake, tag) for tag in ("one", "two")}
    workload = SharedPrefixWorkload(name=NAME, words=WORDS, seed=2)
    systems: dict[str, dict[int, set[str]]] = {}
    for tag, bodies in runs.items():
        systems[tag] = defaultdict(set)
        for conversation_id, sent in bodies.items():
            group = _group(conversation_id)
            for body in sent:  # every turn repeats the same system message first
                first = body["messages"][0]
                assert first["role"] == "system"
                systems[tag][group].add(first["content"])
            user = sent[0]["messages"][1]
            assert user["role"] == "user"
            assert user["content"].startswith(f"[{conversation_id}] ")  # the conversation's own marker
        for group, texts in systems[tag].items():
            assert len(texts) == 1  # within a run, a group's conversations send the very same prompt
            (text,) = texts
            prefix = workload.prefix(group)
            assert text == f"[{prefix.id}-r{tag}] {prefix.content}"
        assert len({next(iter(t)) for t in systems[tag].values()}) == len(systems[tag]) >= 2
    # Another run sends the same prompt text behind another marker: no cached block carries over.
    for group in systems["one"].keys() & systems["two"].keys():
        (a,), (b,) = systems["one"][group], systems["two"][group]
        assert a.split("] ", 1)[1] == b.split("] ", 1)[1]
        assert a[:40] != b[:40]


async def test_records_count_the_prompt_in_turn_one_without_the_markers(fake: FakeWorker) -> None:
    workload = SharedPrefixWorkload(name=NAME, words=WORDS, seed=2)
    records = (await run_load(_settings(fake.url, "rec"), workload)).records
    assert {(r.n_in, r.n_out) for r in records if r.turn == 1} == {(256 + 128, 128)}
    assert {(r.n_in, r.n_out) for r in records if r.turn == 2} == {(16, 32)}
    assert {r.workload for r in records} == {NAME}


async def test_without_isolation_the_prompt_is_the_workloads_text_as_it_is(fake: FakeWorker) -> None:
    bodies = await _run(fake, "raw", isolate_prefix_cache=False)
    workload = SharedPrefixWorkload(name=NAME, words=WORDS, seed=2)
    for conversation_id, sent in bodies.items():
        assert sent[0]["messages"][0]["content"] == workload.prefix(_group(conversation_id)).content


async def test_a_real_worker_serves_a_groups_second_conversation_from_its_prefix_cache(
    fake: FakeWorker,
) -> None:
    """The bodies one run sent, replayed one at a time to a simulated vLLM worker (exact Llama-3 tokens,
    chat template, 16-token blocks): a group's second conversation finds the shared prompt cached, a
    conversation of another group or another run finds none of it."""
    first = await _run(fake, "one")
    second = await _run(fake, "two")
    by_group: dict[int, list[str]] = defaultdict(list)
    for conversation_id in sorted(first):
        by_group[_group(conversation_id)].append(conversation_id)
    a, b = by_group[0][:2]
    (other,) = by_group[1][:1]
    rerun = next(c for c in second if _group(c) == 0)

    group = await start_alone("R0", "replica")
    try:
        url = group.worker("R0").url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

            async def cached(body: dict[str, Any]) -> float:
                turn1 = {"messages": body["messages"], "max_tokens": 1}
                before = await metric(http, url, "vllm:prefix_cache_hits_total")
                status, answer = await post(http, f"{url}/v1/chat/completions", turn1)
                assert status == 200, answer
                return await metric(http, url, "vllm:prefix_cache_hits_total") - before

            assert await cached(first[a][0]) == 0
            shared = await cached(first[b][0])
            # Another group's and another run's first conversations share only the chat template's
            # fixed header (its date line) and the start of the marks with what is cached.
            header = await cached(first[other][0])
            assert header < 64
            assert await cached(second[rerun][0]) < 64
            # The group's second conversation reuses the whole system message (header, run marker,
            # the 256 prompt tokens) in whole 16-token blocks, and nothing of its own part.
            assert shared % 16 == 0
            assert shared - header >= 256 - 16
            system = COUNTER.count(first[b][0]["messages"][0]["content"])
            assert shared <= header + system + 16
    finally:
        await group.stop()

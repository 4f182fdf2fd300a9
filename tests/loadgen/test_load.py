from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from loadgen.load import LoadError, LoadSettings, path_taken, run_load
from loadgen.tokens import llama3_counter
from loadgen.workloads import SyntheticWorkload, single_token_words
from ppd.arrivals import poisson_arrivals
from table_builder.records import Record
from tests.support.fake_openai import MODEL, FakeWorker, Knobs

WORDS = single_token_words(llama3_counter())

pytestmark = pytest.mark.integration


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeWorker, str]]:
    server = await FakeWorker("fake", "replica").start()
    yield server, server.url
    await server.close()


def _settings(url: str, **kw: object) -> LoadSettings:
    base: dict[str, object] = {
        "url": url,
        "qps": 20.0,
        "duration_s": 0.5,
        "run_id": "t",
        "workload": "small_tiny",
        "seed": 4,
        "mode": "pd",
    }
    base.update(kw)
    return LoadSettings(**base)  # type: ignore[arg-type]


def test_path_comes_from_the_gateway_header_else_from_the_mode() -> None:
    assert path_taken({"X-PPD-Path": "local"}, "ppd", 2) == "local"
    assert path_taken({"X-PPD-Path": "bidir"}, "bidir", 2) == "bidir"
    assert path_taken({}, "local", 2) == "local"
    assert path_taken({}, "local", 1) == "pd"
    assert path_taken({}, "replica", 1) == "replica"
    assert path_taken({"X-PPD-Path": "bogus"}, "pd", 2) == "pd"


async def test_a_run_sends_every_turn_with_exact_lengths_and_records_it(fake: tuple[FakeWorker, str]) -> None:
    server, url = fake
    server.knobs.path_header = "local"
    seen: list[Record] = []
    settings = _settings(url, send_mode_header=True, mode="ppd")
    result = await run_load(
        settings, SyntheticWorkload(name="small_tiny", words=WORDS, seed=4), on_record=seen.append
    )
    arrivals = poisson_arrivals(random.Random("arrivals:4"), 20.0, 0.5)
    assert result.conversations == len(arrivals) > 0
    assert len(result.records) == 2 * len(arrivals) == len(seen)
    assert all(r.ok and r.error is None for r in result.records)
    first = [r for r in result.records if r.turn == 1]
    second = [r for r in result.records if r.turn == 2]
    assert {(r.n_in, r.n_out, r.n_ctx) for r in first} == {(128, 128, 0)}
    for r in second:
        assert (r.n_in, r.n_out) == (16, 32)
        assert r.n_ctx > 128  # the server's usage: prompt + completion of turn 1
        assert r.path == "local"
        assert r.tpot_ms is not None
        assert r.ttft_ms is not None
        assert r.e2e_ms is not None
        assert r.tpot_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / 31)
    bodies = server.bodies()
    assert {b["max_tokens"] for b in bodies} == {128, 32}
    assert all(b["ignore_eos"] and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert all(b["model"] == MODEL for b in bodies)  # from GET /v1/models
    assert all(s.headers["X-PPD-Mode"] == "ppd" and s.headers["X-Session-ID"] for s in server.completions())
    turn2 = [b for b in bodies if len(b["messages"]) == 3]
    assert turn2
    assert all(
        b["messages"][1]["role"] == "assistant" and b["messages"][1]["content"].startswith("w0 w1")
        for b in turn2
    )  # history holds the answer the server really gave


@pytest.mark.parametrize(
    ("knobs", "error"),
    [
        (Knobs(status=500), "http 500"),
        (Knobs(hang=True), "timeout after 0.3 s"),
        (Knobs(error_event=True), "stream error: fake engine error"),
        (Knobs(no_done=True), "stream ended without [DONE]"),
    ],
    ids=["http500", "hang", "sse_error", "cut"],
)
async def test_failures_become_records_and_stop_the_conversation(
    fake: tuple[FakeWorker, str], knobs: Knobs, error: str
) -> None:
    server, url = fake
    server.knobs = knobs
    result = await run_load(
        # only the hanging server may meet the short deadline; the others must fail for their own reason
        _settings(url, timeout_s=0.3 if knobs.hang else 60.0, served_model="m"),
        SyntheticWorkload(name="small_tiny", words=WORDS),
    )
    assert result.records
    assert all(not r.ok and r.turn == 1 for r in result.records)
    assert all(r.error is not None and r.error.startswith(error) for r in result.records)
    assert all(r.ttft_ms is None and r.tpot_ms is None for r in result.records)


async def test_an_unreachable_server_fails_the_run_with_a_clear_error(fake: tuple[FakeWorker, str]) -> None:
    _, url = fake
    dead = url.rsplit(":", 1)[0] + ":1"
    with pytest.raises(LoadError, match="cannot reach"):
        await run_load(_settings(dead), SyntheticWorkload(name="small_tiny", words=WORDS))


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="qps"):
        _settings("http://x", qps=0.0)
    with pytest.raises(ValueError, match="duration"):
        _settings("http://x", duration_s=float("inf"))


async def test_two_runs_with_the_same_seed_never_share_a_conversation_id(
    fake: tuple[FakeWorker, str],
) -> None:
    """Against one gateway, a rerun's Turn 1s must not join the sessions of the first run."""
    server, url = fake
    workload = SyntheticWorkload(name="small_tiny", words=WORDS, seed=4)
    runs = [await run_load(_settings(url, served_model="m"), workload) for _ in range(2)]
    sent = [s.headers["X-Session-ID"] for s in server.completions()]
    ids = [{r.conversation_id for r in run.records} for run in runs]
    assert ids[0]
    assert not ids[0] & ids[1]
    assert set(sent) == ids[0] | ids[1]  # the records name the id the server was sent
    for run in runs:
        workload_ids = sorted(r.conversation_id.rsplit("-r", 1)[0] for r in run.records if r.turn == 1)
        assert workload_ids == sorted(workload.conversation(i).id for i in range(run.conversations))
    tagged = await run_load(_settings(url, served_model="m", run_tag="rerun1"), workload)
    assert all(r.conversation_id.endswith("-rrerun1") for r in tagged.records)
    with pytest.raises(ValueError, match="run tag"):
        _settings(url, run_tag="a/b")


async def test_two_runs_of_the_same_conversations_share_no_prompt_prefix(
    fake: tuple[FakeWorker, str],
) -> None:
    """Workers cache by token content: a rerun's prompts must not start like the first run's, or the
    second run (local after pd, say) measures prefills the first one already computed."""
    server, url = fake
    workload = SyntheticWorkload(name="small_tiny", words=WORDS, seed=4)
    for tag in ("one", "two"):
        await run_load(_settings(url, served_model="m", run_tag=tag), workload)
    firsts: dict[str, list[str]] = {"one": [], "two": []}
    for seen in server.completions():
        tag = seen.headers["X-Session-ID"].rsplit("-r", 1)[1]
        firsts[tag].append(seen.body["messages"][0]["content"])
    assert firsts["one"]
    assert firsts["two"]
    # The same workload text behind a marker naming the conversation (and so the run).
    for tag, texts in firsts.items():
        assert all(t.startswith("[") and f"-r{tag}] " in t for t in texts)
    strip = {tag: {t.split("] ", 1)[1] for t in texts} for tag, texts in firsts.items()}
    assert strip["one"] == strip["two"]
    assert not {t[:40] for t in firsts["one"]} & {t[:40] for t in firsts["two"]}


async def test_without_isolation_a_run_sends_the_workloads_text_as_it_is(
    fake: tuple[FakeWorker, str],
) -> None:
    server, url = fake
    workload = SyntheticWorkload(name="small_tiny", words=WORDS, seed=4)
    await run_load(_settings(url, served_model="m", isolate_prefix_cache=False), workload)
    texts = {s.body["messages"][0]["content"] for s in server.completions()}
    assert texts == {workload.conversation(i).turns[0].content for i in range(len(texts))}

"""Gateway features beyond the core path: ppd mode over gRPC, sessions at the HTTP level, the admin
API, the pass-through routes, metrics and the request log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ppd.decision.v1 import decision_pb2
from tests.gateway.conftest import MODEL, StackFactory, follow_up
from tests.gateway.fake_decision import FakeDecision
from tests.support.metrics import sample, samples

# ---------------------------------------------------------------- ppd mode


async def test_ppd_mode_asks_the_decision_service_from_turn_two(
    make_stack: StackFactory, decision: FakeDecision
) -> None:
    stack = await make_stack(mode="ppd", decision={"address": decision.address, "deadline_ms": 2000.0})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    first = await stack.chat(messages, max_tokens=6)
    assert (first.path, first.reason) == ("pd", "turn_one")
    assert not decision.seen  # turn 1 never asks
    follow_up(messages, first, "and then")
    second = await stack.chat(messages, max_tokens=6)
    assert (second.path, second.reason, second.headers["X-PPD-Table-Version"]) == ("local", "table", "v-test")
    q = decision.seen[-1]
    assert (q.turn, q.new_input_tokens, q.expected_output_tokens) == (2, 2 + 5, 6)
    assert q.context_tokens > 0  # from the first turn's usage
    assert q.live.HasField("decode_kv_usage")
    decision.decision = decision_pb2.DECISION_PD
    decision.reason = decision_pb2.REASON_WEIGHTS
    follow_up(messages, second, "more")
    third = await stack.chat(
        messages, max_tokens=6, stream=True, headers={"X-PPD-Expected-Output-Tokens": "42"}
    )
    assert (third.path, third.reason, third.headers["X-PPD-Turn"]) == ("pd", "weights", "3")
    assert decision.seen[-1].expected_output_tokens == 42
    assert third.headers["X-PPD-Decode-Worker"] == first.headers["X-PPD-Decode-Worker"]


async def test_ppd_mode_falls_back_when_the_service_is_down(make_stack: StackFactory) -> None:
    svc = await FakeDecision().start()
    address = svc.address
    await svc.stop()
    stack = await make_stack(
        mode="ppd", decision={"address": address, "deadline_ms": 500.0, "fallback": "local"}
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages)
    follow_up(messages, first, "again")
    second = await stack.chat(messages)
    assert second.status == 200
    assert second.path == "local"
    assert second.reason.startswith("fallback_")
    assert second.headers["X-PPD-Fallback"] == "1"
    metrics = (await stack.http.get(stack.url + "/metrics")).content
    text = (await metrics.read()).decode()
    assert samples(text, "ppd_gateway_decision_fallbacks_total")


async def test_mode_header_overrides_the_config_where_the_operator_allows_it(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(mode="local", allow_mode_header=True)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages)
    follow_up(messages, first, "again")
    second = await stack.chat(messages, headers={"X-PPD-Mode": "pd"})
    assert (second.path, second.reason, second.headers["X-PPD-Mode"]) == ("pd", "mode_pd", "pd")


async def test_the_mode_header_is_ignored_by_default(make_stack: StackFactory) -> None:
    """A client does not choose its routing unless the operator allows it (allow_mode_header): the
    header is not read at all, and the response's X-PPD-Mode names the mode that was used."""
    stack = await make_stack(mode="local")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages, headers={"X-PPD-Mode": "replica"})
    assert (first.status, first.path, first.headers["X-PPD-Mode"]) == (200, "pd", "local")
    follow_up(messages, first, "again")
    second = await stack.chat(messages, headers={"X-PPD-Mode": "pd"})
    assert (second.path, second.reason, second.headers["X-PPD-Mode"]) == ("local", "mode_local", "local")
    follow_up(messages, second, "more")
    third = await stack.chat(messages, headers={"X-PPD-Mode": "fraction:7"})  # not even parsed
    assert (third.status, third.path) == (200, "local")


@pytest.mark.parametrize(
    ("roles", "mode", "header", "says"),
    [
        (None, "local", "replica", "no replica workers"),
        (None, "local", "bidir", "routing.bidir"),
        ({"R0": "replica"}, "replica", "pd", "no decode workers"),
        ({"R0": "replica"}, "replica", "ppd", "no decode workers"),
    ],
)
async def test_a_mode_header_the_pool_cannot_serve_is_a_400(
    make_stack: StackFactory, roles: dict[str, str] | None, mode: str, header: str, says: str
) -> None:
    stack = await make_stack(roles, mode=mode, allow_mode_header=True)
    reply = await stack.chat([{"role": "user", "content": "hello"}], headers={"X-PPD-Mode": header})
    assert reply.status == 400, reply.body
    assert reply.body["error"]["param"] == "X-PPD-Mode"
    assert says in reply.body["error"]["message"]
    assert all(not w.completions() for w in stack.workers.values())


async def test_fraction_mode_is_stable_per_conversation(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="fraction:0.5")
    paths = set()
    for c in range(8):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"conversation {c}"}]
        seen = []
        for t in range(3):
            # Fixed ids: which conversations go local is then fixed too (no chance in the test).
            reply = await stack.chat(messages, headers={"X-Session-ID": f"conversation-{c}"})
            seen.append(reply.path)
            follow_up(messages, reply, f"turn {t}")
        assert seen[0] == "pd"
        assert seen[1] == seen[2]  # the same conversation never flips
        paths.add(seen[1])
    assert paths == {"pd", "local"}


# ---------------------------------------------------------------- sessions over HTTP


async def test_regeneration_and_edit_find_the_same_session(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages)
    follow_up(messages, first, "question A")
    second = await stack.chat(messages)
    regenerated = await stack.chat(messages)
    edited = await stack.chat([*messages[:-1], {"role": "user", "content": "question B"}])
    for reply in (second, regenerated, edited):
        assert (reply.path, reply.headers["X-PPD-Turn"]) == ("local", "2")
        assert reply.headers["X-PPD-Session-Id"] == first.headers["X-PPD-Session-Id"]


async def test_conversations_starting_alike_are_separate_sessions(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    a = await stack.chat([{"role": "user", "content": "hi"}])
    b = await stack.chat([{"role": "user", "content": "hi"}])
    assert a.headers["X-PPD-Session-Id"] != b.headers["X-PPD-Session-Id"]
    unknown = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "never said"}]
    c = await stack.chat([*unknown, {"role": "user", "content": "x"}])
    assert (c.path, c.headers["X-PPD-Turn"]) == ("pd", "1")  # no KV anywhere for an unknown history


async def test_session_lookups_are_counted_by_outcome(make_stack: StackFactory) -> None:
    """exact: the state of the request's whole history; prefix: an earlier one (turns after it were
    never seen here); miss: none. A first turn looks nothing up."""
    stack = await make_stack(mode="local")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages)
    follow_up(messages, first, "question A")
    second = await stack.chat(messages)
    assert second.headers["X-PPD-Turn"] == "2"
    # Two more turns this gateway never saw (answered elsewhere): the longest known state is turn 1's.
    unseen = [*messages, {"role": "assistant", "content": "from elsewhere"}, {"role": "user", "content": "B"}]
    third = await stack.chat(unseen)
    assert (third.headers["X-PPD-Turn"], third.headers["X-PPD-Session-Id"]) == (
        "2",
        first.headers["X-PPD-Session-Id"],
    )
    stranger = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "never said"}]
    fourth = await stack.chat([*stranger, {"role": "user", "content": "x"}])
    assert fourth.headers["X-PPD-Turn"] == "1"
    registry = stack.deps.metrics.registry
    counted = {
        r: sample(registry, "ppd_gateway_session_lookups_total", result=r)
        for r in ("exact", "prefix", "miss")
    }
    assert counted == {"exact": 1, "prefix": 1, "miss": 1}


async def test_a_turn_remembered_without_its_answer_is_continued(make_stack: StackFactory) -> None:
    """What the Envoy picker will do: remember a turn by what it was sent, never seeing the answer.
    The follow-up, sent to this gateway's HTTP port, continues that session on its decode worker."""
    from gateway.session_lookup import remember_turn
    from gateway.sessions import KeyChain, Session

    stack = await make_stack(mode="local")
    sent = [{"role": "user", "content": "tell me a story"}]
    after = Session("picked-1").after_turn(
        worker="D1",
        prompt_tokens=12,
        completion_tokens=30,
        history_key=KeyChain(MODEL).extend(sent).key(),
        history_messages=len(sent),
    )
    await remember_turn(stack.deps.sessions, after, explicit_id=None)
    reply = await stack.chat([*sent, {"role": "assistant", "content": "Once upon a time"},
                              {"role": "user", "content": "and then?"}])  # fmt: skip
    assert reply.status == 200, reply.body
    assert (reply.path, reply.headers["X-PPD-Turn"], reply.headers["X-PPD-Session-Id"]) == (
        "local",
        "2",
        "picked-1",
    )
    assert reply.headers["X-PPD-Decode-Worker"] == "D1"


@pytest.mark.parametrize("where", ["header", "session_id", "conversation_id"])
async def test_explicit_session_id_overrides_content(make_stack: StackFactory, where: str) -> None:
    stack = await make_stack(mode="local")
    headers = {"X-Session-ID": "conv-42"} if where == "header" else {}
    extra: dict[str, Any] = {where: "conv-42"} if where != "header" else {}
    first = await stack.chat([{"role": "user", "content": "a"}], headers=headers, **extra)
    # The answer comes back in another form (its content key is unknown), same explicit id: the id finds
    # the conversation, which this history continues.
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "reworded"}]
    second = await stack.chat([*history, {"role": "user", "content": "b"}], headers=headers, **extra)
    assert first.headers["X-PPD-Session-Id"] == second.headers["X-PPD-Session-Id"] == "conv-42"
    assert (second.path, second.headers["X-PPD-Turn"]) == ("local", "2")
    assert "X-PPD-Session-Reset" not in second.headers
    d = stack.workers[second.headers["X-PPD-Decode-Worker"]]
    if where != "header":
        assert d.completions()[-1].body[where] == "conv-42"  # unknown-to-us fields pass through


async def test_reused_session_id_with_a_new_history_is_a_new_conversation(make_stack: StackFactory) -> None:
    """A second benchmark run with the same conversation ids: its Turn 1 must not join the old session."""
    stack = await make_stack(mode="local")
    sid = {"X-Session-ID": "small_tiny-s0-0"}
    resets = stack.deps.metrics.registry
    for run in range(2):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
        first = await stack.chat(messages, headers=sid)
        assert (first.path, first.reason, first.headers["X-PPD-Turn"]) == ("pd", "turn_one", "1")
        assert first.headers.get("X-PPD-Session-Reset") == ("new_history" if run else None)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "b"}]
        second = await stack.chat(messages, headers=sid)
        assert (second.path, second.headers["X-PPD-Turn"]) == ("local", "2")
        assert "X-PPD-Session-Reset" not in second.headers
        assert second.headers["X-PPD-Session-Id"] == "small_tiny-s0-0"
    assert sample(resets, "ppd_gateway_session_resets_total", reason="new_history") == 1
    assert not sample(resets, "ppd_gateway_session_resets_total", reason="fork")
    # Another history under the same id that shares nothing with it: a new conversation again.
    other = await stack.chat([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                              {"role": "user", "content": "z"}], headers=sid)  # fmt: skip
    assert (other.path, other.headers["X-PPD-Turn"], other.headers["X-PPD-Session-Reset"]) == (
        "pd",
        "1",
        "new_history",
    )


async def test_named_session_edited_back_to_an_earlier_turn_is_a_fork(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    sid = {"X-Session-ID": "conv-7"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    first = await stack.chat(messages, headers=sid)
    messages += [{"role": "assistant", "content": first.text}]
    second = await stack.chat([*messages, {"role": "user", "content": "b"}], headers=sid)
    assert second.headers["X-PPD-Turn"] == "2"
    # The user edits turn 2: the history is turn 1's, which the id's latest state does not extend.
    edited = await stack.chat([*messages, {"role": "user", "content": "b, reworded"}], headers=sid)
    assert (edited.path, edited.headers["X-PPD-Turn"], edited.headers["X-PPD-Session-Reset"]) == (
        "local",
        "2",
        "fork",
    )
    assert edited.headers["X-PPD-Decode-Worker"] == first.headers["X-PPD-Decode-Worker"]
    assert edited.headers["X-PPD-Session-Id"] == "conv-7"
    assert sample(stack.deps.metrics.registry, "ppd_gateway_session_resets_total", reason="fork") == 1


async def test_completions_endpoint_with_session_id(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 3, "session_id": "c1"}
    first = await stack.post("/v1/completions", body)
    assert (first.status, first.path) == (200, "pd")
    # A follow-up prompt is the last one, its answer, then more (what the decode worker holds).
    follow = "Once" + first.text + " more"
    second = await stack.post("/v1/completions", body | {"prompt": follow, "stream": True})
    assert (second.status, second.path, second.headers["X-PPD-Turn"]) == (200, "local", "2")
    assert second.events[-1] == "[DONE]"
    third = await stack.post("/v1/completions", body | {"prompt": "Once more"})  # not an extension
    assert (third.path, third.headers["X-PPD-Turn"], third.headers["X-PPD-Session-Reset"]) == (
        "pd",
        "1",
        "new_history",
    )


async def test_session_survives_idle_below_ttl_and_the_store_is_bounded(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local", sessions={"max_entries": 3})
    for i in range(10):
        await stack.chat([{"role": "user", "content": f"conversation {i}"}])
    assert len(stack.deps.sessions) == 3


# ---------------------------------------------------------------- admin API


async def test_registered_worker_serves_and_can_be_removed(make_stack: StackFactory) -> None:
    stack = await make_stack({"P0": "prefill", "D0": "decode"}, admin_token="tok")
    auth = {"Authorization": "Bearer tok"}
    d0 = stack.workers["D0"]
    await d0.close()  # the static D is gone; only a registered one can serve
    stack.deps.pool.mark_failed("D0")
    from tests.support.fake_openai import FakeWorker

    extra = await FakeWorker("D5", "decode").start()
    stack.workers["D5"] = extra
    reg = await stack.post("/admin/workers", {"id": "D5", "role": "decode", "url": extra.url}, headers=auth)
    assert reg.status == 201
    assert (
        await stack.post("/admin/workers", {"id": "D5", "role": "decode", "url": extra.url}, headers=auth)
    ).status == 200
    reply = await stack.chat([{"role": "user", "content": "x"}])
    assert (reply.status, reply.headers["X-PPD-Decode-Worker"]) == (200, "D5")
    listing = await stack.http.get(stack.url + "/admin/workers", headers=auth)
    assert {w["id"] for w in (await listing.json())["workers"]} == {"P0", "D0", "D5"}
    gone = await stack.http.delete(stack.url + "/admin/workers/D5", headers=auth)
    assert gone.status == 200
    again = await stack.http.delete(stack.url + "/admin/workers/D5", headers=auth)
    assert again.status == 404
    reply = await stack.chat([{"role": "user", "content": "y"}])
    assert (reply.status, "decode" in reply.body["error"]["message"]) == (503, True)


@pytest.mark.parametrize(
    "body",
    [
        {"id": "D5", "role": "decode"},
        {"id": "D5", "role": "gpu", "url": "http://x:1"},
        {"id": "P0", "role": "prefill", "url": "http://x:1"},
    ],
)
async def test_bad_registrations_are_400(make_stack: StackFactory, body: dict[str, str]) -> None:
    stack = await make_stack(admin_token="tok")
    reply = await stack.post("/admin/workers", body, headers={"Authorization": "Bearer tok"})
    assert reply.status == 400


# ---------------------------------------------------------------- pass-through routes, health, metrics, log


async def test_models_tokenize_detokenize_health(make_stack: StackFactory) -> None:
    stack = await make_stack()
    models = await (await stack.http.get(stack.url + "/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    tok = await stack.post("/tokenize", {"model": MODEL, "prompt": "a b c"})
    assert (tok.status, tok.body["count"]) == (200, 3)
    detok = await stack.post("/detokenize", {"model": MODEL, "tokens": [1, 2]})
    assert detok.body == {"prompt": "1 2"}
    bad = await stack.post("/tokenize", None, raw=b"nope")
    assert bad.status == 400
    health = await stack.http.get(stack.url + "/health")
    assert health.status == 200
    for w in ("D0", "D1"):
        stack.deps.pool.mark_failed(w)
    assert (await stack.http.get(stack.url + "/health")).status == 503


async def test_models_is_answered_without_workers(make_stack: StackFactory) -> None:
    stack = await make_stack({"P0": "prefill"})
    await stack.workers["P0"].close()
    stack.deps.pool.mark_failed("P0")
    models = await (await stack.http.get(stack.url + "/v1/models")).json()
    assert models["data"][0]["id"] == MODEL


async def test_metrics_show_decisions_ttft_and_sessions(make_stack: StackFactory) -> None:
    stack = await make_stack(mode="local")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages, stream=True)
    follow_up(messages, first, "again")
    await stack.chat(messages, stream=True)
    text = await (await stack.http.get(stack.url + "/metrics")).text()
    assert sample(text, "ppd_gateway_decisions_total", path="pd", reason="turn_one") == 1
    assert sample(text, "ppd_gateway_decisions_total", path="local", reason="mode_local") == 1
    ttft = "ppd_gateway_time_to_first_token_seconds_count"
    tpot = "ppd_gateway_time_per_output_token_seconds_count"
    assert sample(text, ttft, path="local", turn_class="later") == 1
    assert sample(text, tpot, path="pd", turn_class="first") == 1
    # Two chat turns, two entries each: under what the turn was sent and under that + its answer.
    assert sample(text, "ppd_gateway_sessions") == 4
    assert sample(text, "ppd_gateway_token_counts_total", source="exact") == 2


async def test_request_log_writes_benchmark_records(make_stack: StackFactory, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    stack = await make_stack(
        mode="local",
        log={
            "request_log": str(path),
            "run_id": "r1",
            "shape": "2P2D",
            "target_qps": 2.0,
            "workload_header": True,  # a benchmark's operator lets its clients label their lines
        },
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages, stream=True, max_tokens=5)
    follow_up(messages, first, "again")
    await stack.chat(messages, max_tokens=5, headers={"X-PPD-Workload": "small_tiny"})
    stack.deps.request_log.flush()  # type: ignore[union-attr]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["turn"] for r in records] == [1, 2]
    one, two = records
    assert set(one) == {
        "run_id", "shape", "model", "mode", "target_qps", "workload", "conversation_id", "turn", "n_in",
        "n_out", "n_ctx", "path", "ttft_ms", "tpot_ms", "e2e_ms", "ok", "error", "start_time",
    }  # fmt: skip
    assert (one["path"], one["ok"], one["n_out"], one["n_ctx"], one["shape"]) == ("pd", True, 5, 0, "2P2D")
    assert one["ttft_ms"] is not None
    assert (two["path"], two["workload"], two["ttft_ms"]) == ("local", "small_tiny", None)
    assert two["n_ctx"] == (1 + 5) + 5  # the fake worker's usage: prompt words + template, completion
    assert one["conversation_id"] == two["conversation_id"]


async def test_unknown_models_are_counted_by_the_workers_tokenizer_in_ppd_mode(
    make_stack: StackFactory, decision: FakeDecision
) -> None:
    stack = await make_stack(mode="ppd", decision={"address": decision.address, "deadline_ms": 2000.0})
    body: dict[str, Any] = {"model": "acme/unknown", "max_tokens": 3}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "one two three"}]
    first = await stack.post("/v1/chat/completions", body | {"messages": messages})
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "four five"}]
    second = await stack.post("/v1/chat/completions", body | {"messages": messages})
    assert second.status == 200
    d = stack.workers[second.headers["X-PPD-Decode-Worker"]]
    tokenized = [s for s in d.seen if s.path == "/tokenize"]
    assert tokenized
    assert tokenized[-1].body["messages"] == [{"role": "user", "content": "four five"}]
    assert decision.seen[-1].new_input_tokens == len(json.dumps(tokenized[-1].body["messages"]).split())
    text = await (await stack.http.get(stack.url + "/metrics")).text()
    assert sample(text, "ppd_gateway_token_counts_total", source="worker") == 1
    assert sample(text, "ppd_gateway_token_counts_total", source="estimate") == 1
    assert sample(text, "ppd_gateway_worker_tokenize_total", purpose="count") == len(tokenized)


async def test_replica_mode_keeps_the_session_on_its_replica(make_stack: StackFactory) -> None:
    stack = await make_stack({"R0": "replica", "R1": "replica"}, mode="replica")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = await stack.chat(messages, stream=True)
    assert (first.path, first.reason) == ("replica", "mode_replica")
    r = first.headers["X-PPD-Decode-Worker"]
    follow_up(messages, first, "again")
    second = await stack.chat(messages)
    assert (second.path, second.headers["X-PPD-Decode-Worker"], second.headers["X-PPD-Turn"]) == (
        "replica",
        r,
        "2",
    )
    assert "kv_transfer_params" not in stack.workers[r].completions()[-1].body

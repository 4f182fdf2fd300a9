"""The P/D planner as a table of golden cases (tests/gateway/golden/plan/*.json), plus the protocol
rules checked one by one so a golden file can never silently encode a wrong rule.

Regenerate the expected halves after a deliberate change:
    PPD_UPDATE_GOLDEN=1 pytest tests/gateway/test_plan.py
An updating run rewrites the files and then fails every case it rewrote, so a run with the switch left on
can never pass by comparing the output with itself: review the diff, then run again without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import NoWorkerError
from gateway.plan import (
    KV_FIELD,
    PlanRequest,
    bidir_params,
    bidir_retry,
    decode_after_prefill,
    local_fallback,
    plan,
    plan_to_json,
    prefill_body,
    prefill_elsewhere,
    prompt_token_ids,
)
from gateway.pool import Load, PoolView, WorkerView
from gateway.routing import Decision
from gateway.sessions import Session
from ppd.placement import Placement, PlacementSettings

GOLDEN = Path(__file__).parent / "golden" / "plan"
CASES = sorted(GOLDEN.glob("*.json"))


def _pool(rows: list[dict[str, Any]]) -> PoolView:
    return PoolView(
        tuple(
            WorkerView(r["id"], r["role"], r["url"], Load(**r.get("load", {})), r.get("inflight", 0))
            for r in rows
        )
    )


def _run(case: dict[str, Any]) -> dict[str, Any]:
    req = case["request"]
    request = PlanRequest(
        endpoint=req["endpoint"],
        body=req["body"],
        request_id=req["request_id"],
        headers=tuple(tuple(h) for h in req.get("headers", [])),
        inject_usage=req.get("inject_usage", True),
        prefill_attempts=req.get("prefill_attempts", 2),
        now=req.get("now", 0.0),
    )
    session = Session(**case["session"]) if case.get("session") else None
    decision = Decision(**case["decision"])
    try:
        p = plan(request, session, decision, _pool(case["pool"]))
    except NoWorkerError as exc:
        return {"error": exc.message}
    out = plan_to_json(p)
    if "p_returns" in case:
        out["decode_after_prefill"] = plan_to_json(local_fallback(p, "x"))["decode"] | {
            "body": decode_after_prefill(p, case["p_returns"]).body
        }
    return out


@pytest.mark.parametrize("path", CASES, ids=[c.stem for c in CASES])
def test_golden(path: Path) -> None:
    case = json.loads(path.read_text())
    body_before = json.dumps(case["request"]["body"], sort_keys=True)
    got = _run(case)
    assert json.dumps(case["request"]["body"], sort_keys=True) == body_before, "plan mutated its input"
    check_golden(path, case, got, update=bool(os.environ.get("PPD_UPDATE_GOLDEN")))


def check_golden(path: Path, case: dict[str, Any], got: dict[str, Any], *, update: bool) -> None:
    """Compare with the file's expected half; when updating, rewrite it and fail (never a pass)."""
    if update:
        case["expected"] = got
        path.write_text(json.dumps(case, indent=2, sort_keys=True) + "\n")
        pytest.fail(f"{path.name} rewritten (PPD_UPDATE_GOLDEN); review the diff and rerun without it")
    assert got == case["expected"]


def test_updating_a_golden_file_fails_the_run(tmp_path: Path) -> None:
    path = tmp_path / "case.json"
    case: dict[str, Any] = {"expected": {"old": 1}}
    with pytest.raises(pytest.fail.Exception, match="rewritten"):
        check_golden(path, case, {"new": 2}, update=True)
    assert json.loads(path.read_text())["expected"] == {"new": 2}
    with pytest.raises(AssertionError):
        check_golden(path, {"expected": {"old": 1}}, {"new": 2}, update=False)


def test_there_are_golden_cases() -> None:
    assert len(CASES) >= 10


BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 50,
    "max_completion_tokens": 40,
    "min_tokens": 5,
    "min_completion_tokens": 5,
    "temperature": 0.3,
    "vendor_field": {"kept": True},
    KV_FIELD: {"remote_host": "evil"},
}


def test_prefill_leg_follows_the_nixl_proxy_rules() -> None:
    p = prefill_body(BODY)
    assert p[KV_FIELD] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert (p["stream"], p["max_tokens"], p["max_completion_tokens"]) == (False, 1, 1)
    for gone in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert gone not in p
    assert p["vendor_field"] == {"kept": True}
    assert p["temperature"] == 0.3
    assert "max_completion_tokens" not in prefill_body({"model": "m", "prompt": "x"})
    assert "return_token_ids" not in p
    assert prefill_body(BODY, token_ids=True)["return_token_ids"] is True


@pytest.mark.parametrize(
    ("answer", "ids"),
    [
        ({"object": "chat.completion", "prompt_token_ids": [128000, 9906]}, [128000, 9906]),
        ({"object": "text_completion", "choices": [{"prompt_token_ids": [1, 2, 3]}]}, [1, 2, 3]),
        ({"prompt_token_ids": None, "choices": [{"index": 0}]}, None),  # not asked, or not said
        ({"prompt_token_ids": []}, None),
        ({"prompt_token_ids": [1, "2"]}, None),
        ({"prompt_token_ids": [1, True]}, None),
        ({"prompt_token_ids": [1, -2]}, None),
        ({"prompt_token_ids": "1 2"}, None),
        ({"choices": "x"}, None),
        ([1, 2], None),
    ],
)
def test_ps_answer_gives_the_prompts_token_ids_when_it_has_them(
    answer: object, ids: list[int] | None
) -> None:
    assert prompt_token_ids(answer) == ids


def test_decode_leg_is_the_original_body_plus_ps_params_and_both_share_the_request_id() -> None:
    pool = _pool(
        [
            {"id": "P0", "role": "prefill", "url": "http://p0"},
            {"id": "D0", "role": "decode", "url": "http://d0"},
        ]
    )
    req = PlanRequest("chat", BODY, "rid-1", inject_usage=False)
    p = plan(req, None, Decision("pd", "turn_one"), pool)
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]]}
    d = decode_after_prefill(p, params)
    expected = {k: v for k, v in BODY.items() if k != KV_FIELD} | {KV_FIELD: params}
    assert d.body == expected
    assert ("X-Request-Id", "rid-1") in d.headers
    assert ("X-Request-Id", "rid-1") in p.prefill[0].headers
    assert decode_after_prefill(p, None).body == {k: v for k, v in BODY.items() if k != KV_FIELD}


def test_decode_gone_is_a_session_bound_to_no_live_decode_worker() -> None:
    from gateway.plan import decode_gone

    pool = _pool(
        [
            {"id": "D0", "role": "decode", "url": "http://d0"},
            {"id": "R0", "role": "replica", "url": "http://r0"},
            {"id": "P0", "role": "prefill", "url": "http://p0"},
        ]
    )
    assert not decode_gone(None, pool)
    assert not decode_gone(Session("s"), pool)  # not bound yet: turn 1
    assert not decode_gone(Session("s", worker="D0"), pool)
    assert decode_gone(Session("s", worker="D9"), pool)  # left the pool (or down)
    assert decode_gone(Session("s", worker="R0"), pool)  # live, but no decode worker
    request = PlanRequest(endpoint="chat", body={"model": "m", "messages": []}, request_id="r")
    gone = plan(request, Session("s", worker="D9"), Decision("local", "table"), pool)
    assert (gone.path, gone.reason, gone.rebound) == ("pd", "decode_gone", True)


D_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[3]]}


@pytest.mark.parametrize(
    ("params", "expires_at", "now", "expected"),
    [
        (json.dumps(D_PARAMS), 100.0, 99.999, (D_PARAMS, "")),
        (json.dumps(D_PARAMS), 100.0, 100.0, (None, "bidir_expired")),  # the expiry itself is too late
        ("", 0.0, 0.0, (None, "bidir_no_params")),
        ("{not json", 100.0, 0.0, (None, "bidir_no_params")),
        ("[1, 2]", 100.0, 0.0, (None, "bidir_no_params")),
        (
            json.dumps({"do_remote_prefill": True, "remote_block_ids": [[3]]}),
            100.0,
            0.0,
            (None, "bidir_no_params"),
        ),
    ],
)
def test_bidirectional_params_are_live_only_from_a_decode_leg_before_their_expiry(
    params: str, expires_at: float, now: float, expected: tuple[dict[str, Any] | None, str]
) -> None:
    session = Session("s", worker="D0", decode_kv_params=params, decode_kv_expires_at=expires_at)
    assert bidir_params(session, now) == expected
    assert bidir_params(None, now) == (None, "bidir_no_params")


def test_a_failed_bidirectional_p_leg_turns_the_plan_into_full_pd() -> None:
    pool = _pool(
        [
            {"id": "P0", "role": "prefill", "url": "http://p0"},
            {"id": "D0", "role": "decode", "url": "http://d0"},
        ]
    )
    session = Session("s", worker="D0", decode_kv_params=json.dumps(D_PARAMS), decode_kv_expires_at=10.0)
    p = plan(PlanRequest("chat", BODY, "rid", now=5.0), session, Decision("bidir", "table"), pool)
    assert (p.path, [c.worker for c in p.prefill]) == ("bidir", ["P0", "P0"])
    assert p.prefill[0].body[KV_FIELD] == D_PARAMS
    assert p.prefill[1].body[KV_FIELD]["remote_block_ids"] is None
    retried = bidir_retry(p)
    assert (retried.path, retried.reason, retried.prefill) == ("pd", "bidir_prefill_failed", p.prefill)
    pd = plan(PlanRequest("chat", BODY, "rid"), None, Decision("pd", "table"), pool)
    assert bidir_retry(pd) == pd


def test_a_p_leg_run_elsewhere_is_a_plain_one_and_bidir_becomes_pd() -> None:
    """Rule 7 (llm-d's decode sidecar sends a plain rule-1 leg, never D's params)."""
    pool = _pool(
        [
            {"id": "P0", "role": "prefill", "url": "http://p0"},
            {"id": "D0", "role": "decode", "url": "http://d0"},
        ]
    )
    session = Session("s", worker="D0", decode_kv_params=json.dumps(D_PARAMS), decode_kv_expires_at=10.0)
    p = plan(PlanRequest("chat", BODY, "rid", now=5.0), session, Decision("bidir", "table"), pool)
    elsewhere = prefill_elsewhere(p)
    assert (elsewhere.path, elsewhere.reason) == ("pd", "bidir_sidecar")
    assert [c.worker for c in elsewhere.prefill] == ["P0"]
    assert elsewhere.prefill[0].body[KV_FIELD]["remote_block_ids"] is None
    assert KV_FIELD not in elsewhere.decode.body
    pd = plan(PlanRequest("chat", BODY, "rid"), None, Decision("pd", "table"), pool)
    assert prefill_elsewhere(pd) == pd


# ------------------------------------------------------------------ rule 8: placement


def _placement_pool() -> PoolView:
    return _pool(
        [
            {"id": "P0", "role": "prefill", "url": "http://p0"},
            {"id": "P1", "role": "prefill", "url": "http://p1", "inflight": 1},
            {"id": "P2", "role": "prefill", "url": "http://p2", "inflight": 9},
            {"id": "D0", "role": "decode", "url": "http://d0"},
            {"id": "D1", "role": "decode", "url": "http://d1", "inflight": 2},
        ]
    )


def _placed(resident: dict[str, int], *, policy: Placement = "prefix", attempts: int = 3) -> PlanRequest:
    return PlanRequest(
        endpoint="chat",
        body={"model": "m", "messages": []},
        request_id="r",
        prefill_attempts=attempts,
        placement=PlacementSettings(policy),
        resident_blocks=resident,
    )


def test_p_goes_to_the_worker_holding_the_prefix_and_retries_follow_least_loaded() -> None:
    p = plan(
        _placed({"P1": 8, "P2": 40}), Session("s", worker="D1"), Decision("pd", "table"), _placement_pool()
    )
    # P2 holds more but is 9 requests busier than P0 (limit 4): P1 wins, then P0, P2 in load order.
    assert [c.worker for c in p.prefill] == ["P1", "P0", "P2"]
    assert (p.prefill_by_prefix, p.decode_by_prefix) == (True, False)
    assert p.decode.worker == "D1"  # the session's D is never moved, however little it holds


def test_nothing_known_or_least_loaded_policy_plans_as_before() -> None:
    pool, session, pd = _placement_pool(), Session("s", worker="D1"), Decision("pd", "table")
    for request in (_placed({}), _placed({"P1": 0}), _placed({"P1": 8}, policy="least_loaded")):
        p = plan(request, session, pd, pool)
        assert ([c.worker for c in p.prefill], p.prefill_by_prefix) == (["P0", "P1", "P2"], False)


def test_turn_one_and_a_rebind_place_d_by_prefix() -> None:
    pool = _placement_pool()
    first = plan(_placed({"D1": 3}), None, Decision("pd", "turn_one"), pool)
    assert (first.decode.worker, first.decode_by_prefix) == ("D1", True)
    gone = plan(_placed({"D1": 3}), Session("s", worker="D9"), Decision("local", "table"), pool)
    assert (gone.path, gone.reason, gone.decode.worker, gone.decode_by_prefix) == (
        "pd",
        "decode_gone",
        "D1",
        True,
    )

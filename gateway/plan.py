"""P/D request planning: (request, session, decision, pool) -> the upstream calls to make. Pure.

Rules from vLLM's NixlConnector proxy protocol (docs/vllm-protocol.md 1.2-1.5):
Rule 1 (P leg): a copy of the client body with `kv_transfer_params` = {do_remote_decode: true,
do_remote_prefill: false, remote_*: null}, `stream` false, `max_tokens` 1 (and
`max_completion_tokens` 1 when the client sent it), no `stream_options`, no `min_tokens` /
`min_completion_tokens`; with `PlanRequest.prompt_token_ids`, `return_token_ids` true (P's answer then
carries the prompt's token ids, which the session keeps as marks: residency.py rule 5).
Rule 2 (D leg): the original body plus P's returned `kv_transfer_params`, unmodified (absent when P
returned none: D then computes the whole prompt itself).
Rule 3: both legs carry the same `X-Request-Id`.
Rule 4: upstream addresses come only from the pool; a client-sent `kv_transfer_params` is dropped
(it would point a worker at an arbitrary KV source).
Rule 5: the session keeps its D (or R) while it is live; if it is gone the turn goes through P to the
least-loaded live D and the session is rebound (reason `decode_gone`, whatever the decision said).
Rule 6 (bidirectional, docs/vllm-protocol.md 3.4): a "bidir" decision on a session whose D is live and
whose last D leg returned `kv_transfer_params` that have not expired (`PlanRequest.now` before
`Session.decode_kv_expires_at`): the first P leg is rule 1's body with `kv_transfer_params` = D's
returned params, unmodified (they say `do_remote_decode: true`, so P pulls the history from D and
computes only the new tokens); the D leg then carries P's params as in rule 2, so D pulls the result
back. The P retries after it are plain rule-1 legs (full PD): once a P has tried to read D's blocks they
may be gone, so a retry recomputes (`bidir_retry`: path pd, reason `bidir_prefill_failed`). Without
params the turn is full PD with reason `bidir_no_params`, with expired ones `bidir_expired`; a gone D is
rule 5 (`decode_gone`). A D running this mode answers every D leg that carries params (pd and bidir)
with its own (`decode_returns_params`; a local leg carries none and gets none), which the front door
keeps with the session and keeps from the client.
Rule 7 (P run elsewhere, llm-d's decode sidecar): `prefill_elsewhere` keeps a pd plan as it is (its
first P named to the sidecar, the D body without P's params) and turns a bidir plan into pd, reason
`bidir_sidecar` (the sidecar sends a plain rule-1 leg, never D's params).
Rule 8 (placement, ppd/placement.py): the P of every leg through P, the D of Turn 1 and the D of a
rebind (rule 5) are placed among the view's live workers of the role (ejected ones are not in it) by
`PlanRequest.placement` over `PlanRequest.resident_blocks` (worker id -> the prompt's leading blocks
it holds, from its KV events; a worker missing is unknown): with `prefix`, the one holding the longest
prefix unless it is more than `max_imbalance` requests busier than the least loaded; otherwise, and
with `least_loaded`, the least loaded. The P retries follow in least-loaded order. The plan says
whether the prefix moved a choice (`prefill_by_prefix`, `decode_by_prefix`). The session's bound D is
never moved. `decode_gone` is the test of rule 5, the only one: the forwarder asks it only to spare
the DecisionService a question whose answer `plan` would overrule.
Deliberate addition: a streaming D leg gets `stream_options.include_usage` when the client did not ask
for it (the gateway needs `usage` for the next turn's context size); the relay then drops that extra
usage-only chunk (`Plan.strip_usage`), so the client sees exactly what it asked for.
Every function returns new dicts; inputs are never mutated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from gateway.errors import NoWorkerError
from gateway.pool import PoolView, WorkerView
from gateway.routing import Decision
from gateway.sessions import Session
from gateway.types import Endpoint, JsonObject, Path, Role
from ppd.placement import LEAST_LOADED, Candidate, PlacementSettings, place, placement_order

__all__ = [
    "KV_FIELD",
    "Plan",
    "PlanRequest",
    "UpstreamCall",
    "bidir_params",
    "bidir_retry",
    "decode_after_prefill",
    "decode_gone",
    "decode_returns_params",
    "local_fallback",
    "plan",
    "plan_to_json",
    "prefill_body",
    "prefill_elsewhere",
    "prompt_token_ids",
]

KV_FIELD = "kv_transfer_params"
_PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_ROUTES: Mapping[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class PlanRequest:
    endpoint: Endpoint
    body: Mapping[str, Any]
    request_id: str
    # Extra headers for every leg (e.g. a forwarded Authorization); X-Request-Id is added here.
    headers: Headers = ()
    inject_usage: bool = True
    prefill_attempts: int = 2
    # Wall-clock seconds (since the epoch) when the request arrived: rule 6's expiry is read against it.
    now: float = 0.0
    # Rule 8: how P and an unbound D are placed, and the prompt's resident blocks per synced worker.
    placement: PlacementSettings = LEAST_LOADED
    resident_blocks: Mapping[str, int] = field(default_factory=dict)
    # Rule 1: P's answer carries the prompt's token ids (for a later turn's placement).
    prompt_token_ids: bool = False


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    worker: str
    url: str
    body: JsonObject
    headers: Headers
    stream: bool


@dataclass(frozen=True, slots=True)
class Plan:
    path: Path
    reason: str
    # P candidates in order: the first, then the ones to retry on. Empty unless path is "pd" or "bidir"
    # (for "bidir" the first carries D's params and the retries are plain P legs: rule 6).
    prefill: tuple[UpstreamCall, ...]
    # The D (or R) leg. For "pd" its body still lacks P's params; see decode_after_prefill.
    decode: UpstreamCall
    strip_usage: bool
    rebound: bool
    # Rule 8: the resident prefix moved the P (the D) away from the least-loaded worker.
    prefill_by_prefix: bool = False
    decode_by_prefix: bool = False


def prefill_body(body: Mapping[str, Any], *, token_ids: bool = False) -> JsonObject:
    out = {
        k: v
        for k, v in body.items()
        if k not in ("stream_options", "min_tokens", "min_completion_tokens", KV_FIELD)
    }
    out[KV_FIELD] = dict(_PREFILL_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if token_ids:
        out["return_token_ids"] = True
    return out


#: The most prompt token ids taken from P's answer (far above any model's context).
_MAX_PROMPT_IDS: Final = 1 << 22


def prompt_token_ids(answer: Any) -> list[int] | None:
    """Rule 1: the prompt's token ids in P's answer to `return_token_ids` (top-level `prompt_token_ids`
    in chat, the first choice's in completions); None when absent or not a list of token ids."""
    if not isinstance(answer, Mapping):
        return None
    ids = answer.get("prompt_token_ids")
    choices = answer.get("choices")
    if ids is None and isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        ids = choices[0].get("prompt_token_ids")
    if not isinstance(ids, list) or not 0 < len(ids) <= _MAX_PROMPT_IDS:
        return None
    if not all(type(t) is int and t >= 0 for t in ids):
        return None
    return ids


def _decode_body(body: Mapping[str, Any], *, inject_usage: bool) -> tuple[JsonObject, bool]:
    out = {k: v for k, v in body.items() if k != KV_FIELD}
    strip = False
    if inject_usage and out.get("stream") is True:
        options = out.get("stream_options")
        if not isinstance(options, Mapping) or options.get("include_usage") is not True:
            merged = dict(options) if isinstance(options, Mapping) else {}
            merged["include_usage"] = True
            out["stream_options"] = merged
            strip = True
    return out, strip


def _call(worker: WorkerView, request: PlanRequest, body: JsonObject, *, stream: bool) -> UpstreamCall:
    headers = (("X-Request-Id", request.request_id), *request.headers)
    return UpstreamCall(worker.id, worker.url + _ROUTES[request.endpoint], body, headers, stream)


def _bound_decode(session: Session | None, pool: PoolView) -> WorkerView | None:
    decode = pool.get(session.worker if session is not None else None)
    return decode if decode is not None and decode.role == "decode" else None


def decode_gone(session: Session | None, pool: PoolView) -> bool:
    """Rule 5: the session is bound to a worker that is not a live decode worker of `pool`, so a
    P/D turn must go through P whatever the decision."""
    return session is not None and session.worker is not None and _bound_decode(session, pool) is None


def bidir_params(session: Session | None, now: float) -> tuple[dict[str, Any] | None, str]:
    """Rule 6: D's returned params if the session holds live ones, else None and the fallback reason."""
    if session is None or not session.decode_kv_params:
        return None, "bidir_no_params"
    try:
        params = json.loads(session.decode_kv_params)
    except ValueError:
        return None, "bidir_no_params"
    if not isinstance(params, dict) or not params.get("do_remote_decode"):
        return None, "bidir_no_params"
    if now >= session.decode_kv_expires_at:
        return None, "bidir_expired"
    return params, ""


def _placed(pool: PoolView, role: Role, request: PlanRequest) -> tuple[list[WorkerView], bool]:
    """Rule 8: the live workers of `role`, the placed one first, the rest least loaded first; and
    whether the prefix moved the choice. Raises NoWorkerError when there are none."""
    ranked = pool.ranked(role)
    if not ranked:
        raise NoWorkerError(role, scope=pool.scope)
    if request.placement.policy == "least_loaded" or not request.resident_blocks or len(ranked) == 1:
        return ranked, False
    resident = request.resident_blocks
    placed = place([Candidate(w.id, w.busy, resident.get(w.id)) for w in ranked], request.placement)
    return [ranked[i] for i in placement_order(len(ranked), placed)], placed.by_prefix


def plan(request: PlanRequest, session: Session | None, decision: Decision, pool: PoolView) -> Plan:
    """Raises NoWorkerError naming the missing role."""
    body, strip = _decode_body(request.body, inject_usage=request.inject_usage)
    stream = body.get("stream") is True
    bound = session.worker if session is not None else None

    if decision.path == "replica":
        replica = pool.get(bound)
        if replica is None or replica.role != "replica":
            replica = pool.least_loaded("replica")
        return Plan(
            "replica",
            decision.reason,
            (),
            _call(replica, request, body, stream=stream),
            strip,
            rebound=bound is not None and replica.id != bound,
        )

    path: Path = decision.path
    reason = decision.reason
    rebound = False
    decode_by_prefix = False
    decode = _bound_decode(session, pool)
    if decode is None:
        decodes, decode_by_prefix = _placed(pool, "decode", request)
        decode = decodes[0]
        if decode_gone(session, pool):
            # The D holding the KV is gone: only P can rebuild it elsewhere.
            path, reason, rebound = "pd", "decode_gone", True
    if path == "local":
        return Plan(
            "local", reason, (), _call(decode, request, body, stream=stream), strip, rebound,
            decode_by_prefix=decode_by_prefix,
        )  # fmt: skip

    if not pool.ranked("prefill"):
        raise NoWorkerError("prefill")
    placed, prefill_by_prefix = _placed(pool, "prefill", request)
    prefills = placed[: max(1, request.prefill_attempts)]
    p_body = prefill_body(request.body, token_ids=request.prompt_token_ids)
    calls = tuple(_call(p, request, p_body, stream=False) for p in prefills)
    if path == "bidir":
        params, why = bidir_params(session, request.now)
        if params is None:
            path, reason = "pd", why
        else:
            calls = (_call(prefills[0], request, p_body | {KV_FIELD: params}, stream=False), *calls)
    return Plan(
        path, reason, calls, _call(decode, request, body, stream=stream), strip, rebound,
        prefill_by_prefix, decode_by_prefix,
    )  # fmt: skip


def decode_after_prefill(p: Plan, kv_params: Mapping[str, Any] | None) -> UpstreamCall:
    """The D leg once P answered: the original body plus P's params, unmodified."""
    if kv_params is None:
        return p.decode
    body = dict(p.decode.body)
    body[KV_FIELD] = dict(kv_params)
    return replace(p.decode, body=body)


def decode_returns_params(call: UpstreamCall) -> bool:
    """Rule 6: whether a D running vLLM's bidirectional mode answers this leg with its own params
    (it does for a leg that carries params: P's, on the pd and bidir paths)."""
    return KV_FIELD in call.body


def bidir_retry(p: Plan) -> Plan:
    """Rule 6: the bidirectional P leg failed and a plain P leg answered; the turn was full PD."""
    return replace(p, path="pd", reason="bidir_prefill_failed") if p.path == "bidir" else p


def prefill_elsewhere(p: Plan) -> Plan:
    """Rule 7: the plan whose P leg another party runs (a plain one): bidir becomes pd."""
    if p.path != "bidir":
        return p
    return replace(p, path="pd", reason="bidir_sidecar", prefill=p.prefill[1:] or p.prefill)


def local_fallback(p: Plan, reason: str) -> Plan:
    """Every P failed: prefill on the chosen D instead (it computes the whole prompt)."""
    return replace(p, path="local", reason=reason, prefill=())


def plan_to_json(p: Plan) -> JsonObject:
    def call(c: UpstreamCall) -> JsonObject:
        return {
            "worker": c.worker,
            "url": c.url,
            "body": c.body,
            "headers": [list(h) for h in c.headers],
            "stream": c.stream,
        }

    return {
        "path": p.path,
        "reason": p.reason,
        "prefill": [call(c) for c in p.prefill],
        "decode": call(p.decode),
        "strip_usage": p.strip_usage,
        "rebound": p.rebound,
    }

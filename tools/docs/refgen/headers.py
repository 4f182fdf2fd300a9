"""The HTTP headers page: every X-* header the gateway's code names, with what it means (written here,
checked both ways against the code: gen_reference.py rule 2)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tools.docs.refgen.common import GENERATED, ROOT, ReferenceError, cell, check_described, string_constants

__all__ = ["HEADERS", "headers_in_code", "headers_page"]


#: Every HTTP header the gateway's code names (rule 2): (direction, meaning). Directions: "request"
#: (read from the client), "response" (written to the client), "upstream" (sent to the workers).
HEADERS: Mapping[str, tuple[str, str]] = {
    "X-Session-ID": ("request", "names the conversation's session; a history that does not extend it "
                     "forks or starts a new one (without it, sessions are found by content)"),
    "X-PPD-Mode": ("request, response", "request: the routing mode for this request (`pd`, `local`, "
                   "`ppd`, `replica`, `bidir`, `fraction:<x>`), honoured only with "
                   "`allow_mode_header = true`, else ignored; a mode the gateway cannot serve is a 400. "
                   "Response: the mode the request was served in"),
    "X-PPD-Expected-Output-Tokens": ("request", "the client's hint of the answer's length (ψ's n_out)"),
    "X-PPD-Workload": ("request", "the request-log workload label, honoured only with "
                       "`[log] workload_header = true`"),
    "X-PPD-Priority": ("request", "with `[admission] enabled`: the request's class, `high`, `normal` or "
                       "`low` (any case; another value is a 400), never above its tenant's "
                       "`max_priority`; without it, its tenant's default class"),
    "X-PPD-Tenant": ("request", "with `[admission] enabled` and no `Authorization: Bearer` key: the "
                     "tenant admission control shares the queue by (as `tenant:<value>`)"),
    "X-PPD-Path": ("response", "where the turn ran: `pd`, `local`, `bidir` or `replica`"),
    "X-PPD-Reason": ("response", "why: the DecisionService's reason (`table`, `weights`, "
                     "`live_signal`, ...) or the gateway's (`turn_one`, `kv_evicted`, `explore`, a "
                     "fallback, `decode_gone`, ...)"),
    "X-PPD-Turn": ("response", "the turn number within the session"),
    "X-PPD-Table-Version": ("response", "the version of the table that decided (when one did)"),
    "X-PPD-Session-Id": ("response", "the session the turn belongs to"),
    "X-PPD-Decode-Worker": ("response", "the decode worker's id"),
    "X-PPD-Prefill-Worker": ("response", "the prefill worker's id, when the turn went through P"),
    "X-PPD-Fallback": ("response", "`1` when the DecisionService did not answer (slow, down or not "
                       "serving) and the configured fallback decided"),
    "X-PPD-Session-Reset": ("response", "set when an explicit session id did not match the history: "
                            "why the turn forked or started a new conversation"),
    "X-PPD-Explored": ("response", "`1` when the request explored the path the table did not choose"),
    "X-Request-Id": ("response, upstream", "the request's id, on the answer and on both legs to the "
                     "workers"),
}  # fmt: skip

_HEADER_NAME = re.compile(r"^X-[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*$")


def headers_in_code() -> set[str]:
    """Every X-* header named by a string constant in the gateway's code."""
    names: set[str] = set()
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        names |= {s for s in string_constants(path) if _HEADER_NAME.match(s)}
    return names


def headers_page() -> str:
    from gateway.turn_report import PROVENANCE_HEADERS

    check_described("HTTP header", headers_in_code(), set(HEADERS))
    undocumented = [h for h in PROVENANCE_HEADERS if "response" not in HEADERS[h][0]]
    if undocumented:
        raise ReferenceError(f"provenance headers not described as response headers: {undocumented}")
    out = [
        "# HTTP headers\n",
        GENERATED.rstrip() + "\n",
        "Every header the gateway (`ppd-gateway serve`, and `ppd-gateway picker` through Envoy) reads "
        "from clients or writes to them, from the names in its code. Every routed response carries "
        "the provenance headers (`gateway/turn_report.py`); the ones that do not apply to a turn are "
        "left out. `Authorization` is forwarded to the workers only with "
        "`forward_authorization = true`; otherwise the workers get `worker_api_key`, if set. The "
        "admin API takes `Authorization: Bearer <admin_token>`.\n",
        "| header | direction | meaning |\n|---|---|---|",
    ]
    order = {h: i for i, h in enumerate(PROVENANCE_HEADERS)}
    for name in sorted(HEADERS, key=lambda h: ("response" in HEADERS[h][0], order.get(h, -1), h)):
        direction, meaning = HEADERS[name]
        out.append(f"| `{name}` | {direction} | {cell(meaning)} |")
    return "\n".join(out).rstrip() + "\n"

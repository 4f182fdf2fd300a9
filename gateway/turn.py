"""One turn (one completion request) as the forwarder serves it: `TurnInputs`, fixed once the request
is understood (its session, mode and ψ), apart from `TurnOutcome`, filled in as it is served. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.openai_types import CompletionRequest
from gateway.psi import Psi
from gateway.routing import Decision
from gateway.sessions import KeyChain, Session
from ppd.modes import Mode

__all__ = ["TurnInputs", "TurnOutcome"]


@dataclass(frozen=True, slots=True)
class TurnInputs:
    request_id: str
    # The forwarder's timer (seconds, monotonic) and the wall clock when the request arrived.
    start: float
    start_wall: float
    req: CompletionRequest
    mode: Mode
    # The session id the client named (header or body); None when the history found the session.
    explicit_id: str | None
    # The session this turn continues; None for a new conversation.
    session: Session | None
    session_id: str
    turn: int
    psi: Psi
    workload: str
    # The content-key chain over every message of this request (chat only): + the answer = next key.
    chain: KeyChain | None
    # Why a named session was not continued ("fork", "new_history"); "" when it was (or none was named).
    session_reset: str

    @property
    def turn_class(self) -> str:
        return "first" if self.turn <= 1 else "later"


@dataclass(slots=True)
class TurnOutcome:
    decision: Decision | None = None
    path: str = ""
    reason: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    rebound: bool = False
    # Output tokens actually produced (usage, else counted); None until the answer is complete.
    completion_tokens: int | None = None
    ttft: float | None = None
    last_token: float | None = None
    # The gateway's own share of the time to first token (see GatewayMetrics.overhead).
    prefill_wait: float = 0.0
    # The last P answer (parsed), whose prompt token ids (asked with return_token_ids: plan.py rule 1)
    # become the session's marks once the turn is over (read then, off the way to the first token).
    prefill_answer: Any = None
    decode_sent: float | None = None
    overhead: float | None = None
    ok: bool = False
    # The whole answer ([DONE] included) was handed to the client: a client that leaves after it
    # (closing before the worker ended its response) left a served turn, no disconnect.
    delivered: bool = False
    error: str | None = None

    def content_at(self, received: float, start: float) -> None:
        """Answer content arrived at `received` (the gateway's timer) for a turn that arrived at
        `start`: the first sets the TTFT, each the last token's time (TPOT spans them)."""
        if self.ttft is None:
            self.ttft = received - start
        self.last_token = received

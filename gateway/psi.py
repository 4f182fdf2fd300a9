"""Measuring ψ for a request: new input tokens, expected output tokens, context tokens (`measure`,
the one place ψ is assembled, into a `Psi`), and the current conversation arrival rate (`QpsMeter`).

Rule 1 (n_in): exact count with `quicktok` when the served model is a Llama-3 or Qwen family model
(plus a fixed chat-template overhead per message); otherwise the caller asks a worker's `/tokenize`;
otherwise a character estimate. The `source` says which, so a metric can show it. The worker is asked
through a callable the forwarder passes in (only in `ppd` mode, turn 2+, when the DecisionService
will be asked), so this module stays pure.
Rule 2 (n_out): a client hint header wins; then an `ignore_eos` request's limit (the output is exactly
that long); then the session's mean past output, capped by the limit; then the limit; then a default.
Never a dataset oracle.
Rule 3 (q): a sliding window of fixed buckets (memory O(buckets), not O(requests)), with hysteresis:
the reported rate moves only when the measured one leaves a band around it, so a conversation does
not flip cells every turn on noise.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gateway.sessions import Session
from gateway.types import Clock
from gateway.window_counts import WindowCounts

__all__ = [
    "CHARS_PER_TOKEN",
    "TEMPLATE_TOKENS_PER_MESSAGE",
    "Psi",
    "QpsMeter",
    "TokenCount",
    "Tokenizers",
    "estimate_tokens",
    "expected_output",
    "measure",
    "message_text",
    "request_limit",
    "with_resident",
]

CHARS_PER_TOKEN = 4.0
# Llama-3: <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>; Qwen's ChatML is the same size.
TEMPLATE_TOKENS_PER_MESSAGE = 5
TokenSource = Literal["exact", "worker", "estimate"]
OutputSource = Literal["hint", "ignore_eos", "history", "limit", "default"]
# Asks a worker's /tokenize for the new input's token count; None when it could not say.
WorkerCount = Callable[[], Awaitable[int | None]]


@dataclass(frozen=True, slots=True)
class TokenCount:
    tokens: int
    source: TokenSource


@dataclass(frozen=True, slots=True)
class Psi:
    """ψ of one request, as measured once on arrival (the conversation rate is read when the
    DecisionService is asked)."""

    n_in: TokenCount
    n_out: int
    n_ctx: int
    # Context tokens the decode worker's KV events say it no longer holds (gateway/residency.py):
    # moved from n_ctx into n_in by `with_resident`; 0 when nothing was evicted or events are off.
    n_evicted: int = 0


class _Encoding(Protocol):
    def count(self, text: str) -> int: ...


class Tokenizers:
    """Exact tokenizers by served model name, resolved once per name (bounded cache)."""

    def __init__(self, *, max_models: int = 64) -> None:
        self._by_model: dict[str, _Encoding | None] = {}
        self._max = max_models

    def encoding(self, model: str) -> _Encoding | None:
        if model in self._by_model:
            return self._by_model[model]
        enc: _Encoding | None
        try:
            import quicktok

            enc = quicktok.encoding_for_model(model)
        except (KeyError, RuntimeError, ValueError):
            enc = None
        if len(self._by_model) >= self._max:
            self._by_model.clear()
        self._by_model[model] = enc
        return enc

    def count_messages(self, model: str, messages: Sequence[Mapping[str, Any]]) -> TokenCount | None:
        enc = self.encoding(model)
        if enc is None:
            return None
        total = sum(enc.count(message_text(m)) + TEMPLATE_TOKENS_PER_MESSAGE for m in messages)
        return TokenCount(total, "exact")

    def count_text(self, model: str, text: str) -> TokenCount | None:
        enc = self.encoding(model)
        return None if enc is None else TokenCount(enc.count(text), "exact")


def message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def estimate_tokens(text: str) -> TokenCount:
    return TokenCount(max(1, round(len(text) / CHARS_PER_TOKEN)) if text else 0, "estimate")


def request_limit(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def expected_output(
    body: Mapping[str, Any], *, hint: int | None, session: Session | None, default: int
) -> tuple[int, OutputSource]:
    if hint is not None and hint > 0:
        return hint, "hint"
    limit = request_limit(body)
    if limit is not None and body.get("ignore_eos") is True:
        return limit, "ignore_eos"
    mean = session.mean_output() if session is not None else None
    if mean is not None:
        n = max(1, round(mean))
        return (min(n, limit) if limit is not None else n), "history"
    if limit is not None:
        return limit, "limit"
    return default, "default"


class QpsMeter:
    """Events per second over the last `window_s`, with a relative hysteresis band.

    The gateway records one event per conversation started (a Turn 1, or a session reset), so the rate
    is in the unit decision tables index QPS by: conversations arriving per second, as in the benchmark
    runs the tables were built from (a turn-counting rate would read a 3-turn workload at 3x its level).
    """

    def __init__(self, *, window_s: float, hysteresis: float, clock: Clock, buckets: int = 20) -> None:
        if window_s <= 0 or buckets <= 0 or hysteresis < 0:
            raise ValueError("window_s and buckets must be positive, hysteresis non-negative")
        self._clock = clock
        self._width = window_s / buckets
        self._window = window_s
        self._counts = WindowCounts(window_s, buckets=buckets)
        self._hysteresis = hysteresis
        self._reported = 0.0
        self._started = clock()

    def record(self) -> None:
        self._counts.add(self._clock())

    def measured(self) -> float:
        now = self._clock()
        total, _ = self._counts.totals(now)
        # Until a whole window has passed, divide by the time actually observed.
        span = min(self._window, max(now - self._started, self._width))
        return total / span

    def rate(self) -> float:
        measured = self.measured()
        band = self._hysteresis * max(self._reported, 1.0)
        if abs(measured - self._reported) > band:
            self._reported = measured
        return self._reported


def _exact_or_estimate(
    tokenizers: Tokenizers, model: str, messages: Sequence[Mapping[str, Any]] | None, prompt: Any
) -> TokenCount:
    if messages is not None:
        count = tokenizers.count_messages(model, messages)
        text = "".join(message_text(m) for m in messages)
    else:
        text = prompt if isinstance(prompt, str) else ""
        count = tokenizers.count_text(model, text) if text else None
    return count if count is not None else estimate_tokens(text)


async def measure(
    tokenizers: Tokenizers,
    *,
    model: str,
    body: Mapping[str, Any],
    new_messages: Sequence[Mapping[str, Any]] | None,
    session: Session | None,
    hint: int | None,
    default_output: int,
    worker_count: WorkerCount | None = None,
) -> Psi:
    """ψ of a request (rules 1 and 2). `new_messages` are the chat messages this turn adds (None for
    a completions request, whose `prompt` is counted); `worker_count` is asked only when no exact
    tokenizer knows the model."""
    n_in = _exact_or_estimate(tokenizers, model, new_messages, body.get("prompt"))
    if n_in.source == "estimate" and worker_count is not None:
        counted = await worker_count()
        if counted is not None:
            n_in = TokenCount(counted, "worker")
    n_out, _ = expected_output(body, hint=hint, session=session, default=default_output)
    return Psi(n_in, n_out, session.context_tokens if session is not None else 0)


def with_resident(psi: Psi, resident_tokens: int) -> Psi:
    """ψ scored on the resident part of the context: the context the decode worker still holds
    (from its KV events) stays context, the evicted rest must be prefilled again, so it counts as new
    input. Unchanged when the whole context is resident."""
    resident = max(0, min(resident_tokens, psi.n_ctx))
    evicted = psi.n_ctx - resident
    if evicted == 0:
        return psi
    n_in = TokenCount(psi.n_in.tokens + evicted, psi.n_in.source)
    return Psi(n_in, psi.n_out, resident, evicted)

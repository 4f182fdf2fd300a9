"""Multi-turn load generator for any OpenAI-compatible server (our gateway, a bare worker, vLLM).

Rule 1: conversations arrive as a Poisson process at ``qps`` for ``duration_s`` seconds (seeded);
        each turn is sent only after the previous answer has fully arrived, and the next turn's
        history holds the answer the server actually returned (as vLLM's multi-turn benchmark does).
Rule 2: each request streams ``/v1/chat/completions`` with ``ignore_eos`` and ``max_tokens = n_out``,
        so output lengths are exact, and ``stream_options.include_usage`` so the server's own counts
        size ``n_out`` and the next turn's ``n_ctx``.
Rule 3: TTFT is the time to the first non-empty ``delta.content``; TPOT is (e2e - ttft) / (n_out - 1)
        (vLLM's benchmark definition; None for a one-token answer); e2e ends at ``[DONE]``.
Rule 5: every run sends its own conversation ids: the workload's ``<workload>-s<seed>-<index>`` plus
        ``-r<run_tag>`` (random per run unless given), as ``X-Session-ID`` and in the records, so a second
        run with the same seed never joins the sessions a gateway still holds from the first.
Rule 6: every run also sends its own text (``isolate_prefix_cache``, on by default): the first user
        message of each conversation starts with ``[<conversation id>] ``, so no prompt of this run shares a
        prefix-cache block with another run's on the same workers (vLLM and the simulator cache by
        token content, not by id: without it, the local run after a pd run of the same conversations
        would find every Turn 2+ prompt already computed and measure a one-token prefill). Turn 1's
        ``n_in`` in the records is the workload's count, without those few marker tokens.
Rule 7: a conversation with a shared prefix (``Conversation.prefix``, the shared-prefix workloads) is
        sent with it as its first message, role ``system``, in every turn. Rule 6's marker for it names
        the prefix's group and this run, ``[<group id>-r<run_tag>] ``, never the conversation: every
        conversation of a group sends the very same system message within a run (their prompts share
        its KV blocks, which is what the workload measures), and no run shares it with another run.
        The conversation's own marker opens its first user message, after the shared part. Turn 1's
        ``n_in`` in the records counts the prefix's tokens too (they are new input for Turn 1), still
        without the markers.
Rule 4: a request over ``timeout_s`` (30 s), a non-200 status, a dropped connection or an SSE error
        event is a failed request with the reason in ``error``; the rest of that conversation is not
        sent (success rate = completed / sent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from loadgen.workloads import Conversation, Workload
from ppd.arrivals import poisson_arrivals
from table_builder.records import Record

__all__ = [
    "DEFAULT_MODEL",
    "MODE_HEADER",
    "PATH_HEADER",
    "SESSION_HEADER",
    "LoadError",
    "LoadResult",
    "LoadSettings",
    "TurnOutcome",
    "new_run_tag",
    "path_taken",
    "run_load",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL: Final = "meta-llama/Llama-3.1-8B-Instruct"
#: Per-request routing-mode override understood by our gateway (ignored by other servers).
MODE_HEADER: Final = "X-PPD-Mode"
#: The path our gateway reports for a request (``pd``, ``local`` or ``replica``).
PATH_HEADER: Final = "X-PPD-Path"
#: Session id header (vLLM's multi-turn benchmark sends the same with --send-conversation-id).
SESSION_HEADER: Final = "X-Session-ID"
_RUN_TAG = re.compile(r"[A-Za-z0-9_]{1,32}")


def new_run_tag() -> str:
    """A fresh tag for one run's conversation ids (8 hex digits)."""
    return secrets.token_hex(4)


class LoadError(RuntimeError):
    """The run cannot start (server unreachable, no model); individual request failures are records."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSettings:
    """One load run. ``mode`` labels the records; ``send_mode_header`` also asks the gateway for it."""

    url: str
    qps: float
    duration_s: float
    run_id: str
    workload: str
    seed: int = 0
    timeout_s: float = 30.0
    served_model: str | None = None
    shape: str = "1P3D"
    model_label: str = "llama-3.1-8b"
    mode: str = "ppd"
    send_mode_header: bool = False
    send_session_header: bool = True
    api_key: str | None = None
    # Tells this run's conversations from every other run's (rule 5).
    run_tag: str = field(default_factory=new_run_tag)
    # Rule 6: this run's prompts share no prefix-cache block with another run's.
    isolate_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if not _RUN_TAG.fullmatch(self.run_tag):
            raise ValueError(f"run tag must be 1-32 letters, digits or '_', got {self.run_tag!r}")
        if not (self.qps > 0 and math.isfinite(self.qps)):
            raise ValueError(f"qps must be a positive number, got {self.qps}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")


def path_taken(headers: Mapping[str, str], mode: str, turn: int) -> str:
    """The path a request took: the gateway's header when present, else what the mode implies."""
    reported = headers.get(PATH_HEADER, "").strip().lower()
    if reported in ("pd", "local", "replica", "bidir"):
        return reported
    if mode == "replica":
        return "replica"
    if turn > 1 and mode == "local":
        return "local"
    return "pd"


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """What one streamed request measured (times in ms from the moment it was sent)."""

    ok: bool
    error: str | None
    ttft_ms: float | None
    e2e_ms: float | None
    n_out: int
    prompt_tokens: int | None
    text: str
    path: str

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.ttft_ms is None or self.e2e_ms is None or self.n_out < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.n_out - 1)


@dataclass(frozen=True, slots=True)
class LoadResult:
    records: list[Record]
    conversations: int
    wall_s: float


class _Stream:
    """Reads one SSE chat-completion stream; fills in the fields as events arrive."""

    def __init__(self, clock: Callable[[], float], sent: float) -> None:
        self._clock = clock
        self._sent = sent
        self.ttft_ms: float | None = None
        self.chunks = 0
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.done = False

    def feed(self, data: str) -> str | None:
        """Handle one ``data:`` payload; returns an error text for an SSE error event."""
        if data == "[DONE]":
            self.done = True
            return None
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            return f"bad SSE payload: {data[:120]!r}"
        if not isinstance(event, dict):
            return f"bad SSE payload: {data[:120]!r}"
        if "error" in event:
            err = event["error"]
            message = err.get("message") if isinstance(err, dict) else err
            return f"stream error: {message}"
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                if self.ttft_ms is None:
                    self.ttft_ms = (self._clock() - self._sent) * 1000.0
                self.chunks += 1
                self.parts.append(content)
        return None


class _Client:
    def __init__(self, settings: LoadSettings, http: aiohttp.ClientSession, model: str) -> None:
        self._s = settings
        self._http = http
        self._model = model
        self._clock = asyncio.get_running_loop().time

    def _headers(self, conversation_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._s.send_session_header:
            headers[SESSION_HEADER] = conversation_id
        if self._s.send_mode_header:
            headers[MODE_HEADER] = self._s.mode
        if self._s.api_key:
            headers["Authorization"] = f"Bearer {self._s.api_key}"
        return headers

    async def send(
        self, conversation_id: str, turn: int, messages: list[dict[str, str]], n_out: int
    ) -> TurnOutcome:
        body = {
            "model": self._model,
            "messages": messages,
            "max_tokens": n_out,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = self._clock()
        stream = _Stream(self._clock, sent)
        path = path_taken({}, self._s.mode, turn)
        error: str | None
        try:
            async with asyncio.timeout(self._s.timeout_s):
                async with self._http.post(
                    self._s.url.rstrip("/") + "/v1/chat/completions",
                    json=body,
                    headers=self._headers(conversation_id),
                ) as resp:
                    path = path_taken(resp.headers, self._s.mode, turn)
                    error = await _read(resp, stream)
        except TimeoutError:
            error = f"timeout after {self._s.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            error = f"connection: {type(exc).__name__}: {exc}"
        if error is None and not stream.done:
            error = "stream ended without [DONE]"
        if error is None and stream.ttft_ms is None:
            error = "no content in the answer"
        if error is not None or stream.ttft_ms is None:
            return TurnOutcome(False, error, stream.ttft_ms, None, stream.chunks, None, "", path)
        e2e = (self._clock() - sent) * 1000.0
        usage = stream.usage or {}
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        return TurnOutcome(
            ok=True,
            error=None,
            ttft_ms=stream.ttft_ms,
            e2e_ms=e2e,
            n_out=completion if isinstance(completion, int) else stream.chunks,
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            text="".join(stream.parts),
            path=path,
        )


async def _read(resp: aiohttp.ClientResponse, stream: _Stream) -> str | None:
    """Feed the response's SSE lines to ``stream``; an error text, or None when it went well."""
    if resp.status != 200:
        return f"http {resp.status}: {(await resp.text())[:200]}"
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        error = stream.feed(line[5:].strip())
        if error is not None:
            return error
        if stream.done:
            return None
    return None


async def _resolve_model(settings: LoadSettings, http: aiohttp.ClientSession) -> str:
    if settings.served_model:
        return settings.served_model
    url = settings.url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(settings.timeout_s), http.get(url) as resp:
            if resp.status != 200:
                raise LoadError(f"GET {url} answered {resp.status}; pass --model")
            payload = await resp.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise LoadError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    models = payload.get("data") if isinstance(payload, dict) else None
    if not models or not isinstance(models[0], dict) or not isinstance(models[0].get("id"), str):
        raise LoadError(f"GET {url} lists no model; pass --model")
    model: str = models[0]["id"]
    return model


async def run_load(
    settings: LoadSettings,
    workload: Workload,
    *,
    on_record: Callable[[Record], None] | None = None,
    progress: bool = False,
) -> LoadResult:
    """Run the load; every request becomes a ``Record`` (passed to ``on_record`` as it completes)."""
    from tqdm import tqdm

    rng = random.Random(f"arrivals:{settings.seed}")  # noqa: S311 - reproducible, not secret
    arrivals = poisson_arrivals(rng, settings.qps, settings.duration_s)
    conversations = [workload.conversation(i) for i in range(len(arrivals))]
    records: list[Record] = []
    bar = tqdm(
        total=sum(len(c.turns) for c in conversations),
        unit="req",
        desc=f"{settings.workload} @ {settings.qps:g} qps",
        disable=not progress,
        leave=False,
    )
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.timeout_s)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            client = _Client(settings, http, await _resolve_model(settings, http))
            start = loop.time()

            def emit(record: Record) -> None:
                records.append(record)
                if on_record is not None:
                    on_record(record)
                bar.update(1)

            async def converse(conversation: Conversation, offset: float) -> None:
                await asyncio.sleep(max(0.0, start + offset - loop.time()))
                sent = await _conversation(settings, client, conversation, emit)
                bar.update(len(conversation.turns) - sent)  # turns never sent after a failure

            async with asyncio.TaskGroup() as group:
                for conversation, offset in zip(conversations, arrivals, strict=True):
                    group.create_task(converse(conversation, offset))
    finally:
        bar.close()
    return LoadResult(records=records, conversations=len(conversations), wall_s=loop.time() - started)


async def _conversation(
    settings: LoadSettings, client: _Client, conversation: Conversation, emit: Callable[[Record], None]
) -> int:
    """Send the conversation's turns in order; returns how many were sent."""
    messages: list[dict[str, str]] = []
    n_ctx = 0
    n_prefix = 0
    conversation_id = f"{conversation.id}-r{settings.run_tag}"
    prefix = conversation.prefix
    if prefix is not None:  # rule 7
        shared_marker = f"[{prefix.id}-r{settings.run_tag}] " if settings.isolate_prefix_cache else ""
        messages.append({"role": "system", "content": shared_marker + prefix.content})
        n_prefix = prefix.n_tokens
    for number, turn in enumerate(conversation.turns, start=1):
        marker = f"[{conversation_id}] " if number == 1 and settings.isolate_prefix_cache else ""
        messages.append({"role": "user", "content": marker + turn.content})
        n_in = turn.n_in + n_prefix if number == 1 else turn.n_in
        start_time = time.time()
        outcome = await client.send(conversation_id, number, list(messages), turn.n_out)
        emit(
            Record(
                run_id=settings.run_id,
                shape=settings.shape,
                model=settings.model_label,
                mode=settings.mode,
                target_qps=float(settings.qps),
                workload=settings.workload,
                conversation_id=conversation_id,
                turn=number,
                n_in=n_in,
                n_out=outcome.n_out if outcome.ok else turn.n_out,
                n_ctx=n_ctx,
                path=outcome.path,
                ttft_ms=outcome.ttft_ms if outcome.ok else None,
                tpot_ms=outcome.tpot_ms,
                e2e_ms=outcome.e2e_ms,
                ok=outcome.ok,
                error=outcome.error,
                start_time=start_time,
            )
        )
        if not outcome.ok:
            logger.debug("conversation %s turn %d failed: %s", conversation_id, number, outcome.error)
            return number
        messages.append({"role": "assistant", "content": outcome.text})
        if outcome.prompt_tokens is not None:
            n_ctx = outcome.prompt_tokens + outcome.n_out
        else:
            n_ctx += n_in + outcome.n_out
    return len(conversation.turns)

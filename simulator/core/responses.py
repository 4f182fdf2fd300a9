"""vLLM 0.33 response bodies and SSE chunks for completions and chat (pure rendering, no I/O).

Invariants:
- Rule 1: streaming chunks and bodies carry the same fields vLLM serializes; the usage-only final chunk
  (`stream_options.include_usage`) has `choices: []` and drops None fields.
- Rule 2: `kv_transfer_params` appears on the non-streaming body (null unless set) and, when streaming,
  only on the chunk that carries `finish_reason`.
- Rule 3: SSE framing is `data: <compact json>\\n\\n`, ending with `data: [DONE]\\n\\n`.
- Rule 4: a reply whose size follows the request's (`/tokenize`) is serialized in steps
  (`simulator.core.protocol` Rule 4), so that a huge one does not hold the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.core.protocol import SLICE_ITEMS, GenerationRequest, Steps

__all__ = ["SSE_DONE", "ResponseRenderer", "Usage", "sse_event", "tokenize_body_steps"]

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def tokenize_body_steps(
    ids: list[int], *, max_model_len: int, token_str: Callable[[int], str] | None
) -> Steps[str]:
    """The `/tokenize` reply `{count, max_model_len, tokens, token_strs}` as JSON text, `SLICE_ITEMS`
    tokens per step (Rule 4); `token_strs` is null unless `token_str` is given."""
    out = [f'{{"count": {len(ids)}, "max_model_len": {max_model_len}, "tokens": [']
    for start in range(0, len(ids), SLICE_ITEMS):
        out.append((", " if start else "") + json.dumps(ids[start : start + SLICE_ITEMS])[1:-1])
        yield
    out.append('], "token_strs": ')
    if token_str is None:
        out.append("null")
    else:
        out.append("[")
        for start in range(0, len(ids), SLICE_ITEMS):
            strs = [token_str(i) for i in ids[start : start + SLICE_ITEMS]]
            out.append((", " if start else "") + json.dumps(strs)[1:-1])
            yield
        out.append("]")
    out.append("}")
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # set only with --enable-prompt-tokens-details

    def as_json(self, *, drop_none: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        elif not drop_none:
            out["prompt_tokens_details"] = None
        return out


class ResponseRenderer:
    """Renders one request's body or chunks; `response_id` is `cmpl-...` or `chatcmpl-...`."""

    def __init__(self, request: GenerationRequest, *, response_id: str, created: int) -> None:
        self._req = request
        self.response_id = response_id
        self._created = created
        self._chat = request.kind == "chat"
        self._template: tuple[bytes, bytes] | None = None

    def full(
        self,
        *,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str,
        usage: Usage,
        kv_transfer_params: dict[str, Any] | None,
        prompt_text: str | None = None,
    ) -> dict[str, Any]:
        """The non-streaming body."""
        req = self._req
        tokens = list(token_ids) if req.return_token_ids else None
        prompt_tokens = list(req.prompt_ids) if req.return_token_ids else None
        if self._chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": tokens,
            }
            return {
                "id": self.response_id,
                "object": "chat.completion",
                "created": self._created,
                "model": req.model,
                "choices": [choice],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage.as_json(),
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_tokens,
                "kv_transfer_params": kv_transfer_params,
            }
        shown = (prompt_text or "") + text if req.echo else text
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self._created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "text": shown,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_tokens,
                    "token_ids": tokens,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage.as_json(),
            "kv_transfer_params": kv_transfer_params,
        }

    def role_chunk(self, usage: Usage | None) -> dict[str, Any]:
        """Chat's first chunk: `delta: {role: assistant, content: ""}`."""
        chunk = self._chunk_base()
        chunk["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if usage is not None:
            chunk["usage"] = usage.as_json(drop_none=True)
        return chunk

    def delta_chunk(
        self,
        *,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str | None,
        usage: Usage | None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One step's tokens for this stream; `usage` only with `continuous_usage_stats`."""
        chunk = self._chunk_base()
        choice: dict[str, Any]
        if self._chat:
            choice = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        if self._req.return_token_ids:
            choice["token_ids"] = list(token_ids)
        chunk["choices"] = [choice]
        if usage is not None:
            chunk["usage"] = usage.as_json(drop_none=True)
        if finish_reason is not None:
            chunk["kv_transfer_params"] = kv_transfer_params
        return chunk

    def delta_event(self, text: str) -> bytes:
        """`sse_event(delta_chunk(text=text, ...))` for a plain mid-stream chunk, from a cached template.

        Only for chunks without finish reason, usage or token ids; byte-identical to the slow path.
        """
        if self._template is None:
            marker = "\x00text\x00"
            rendered = sse_event(self.delta_chunk(text=marker, token_ids=(), finish_reason=None, usage=None))
            head, _, tail = rendered.partition(json.dumps(marker).encode())
            self._template = (head, tail)
        head, tail = self._template
        return head + json.dumps(text).encode() + tail

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The final `choices: []` chunk sent before `[DONE]` when `include_usage` is set."""
        chunk = self._chunk_base()
        chunk["choices"] = []
        chunk["usage"] = usage.as_json(drop_none=True)
        return chunk

    def _chunk_base(self) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": self._created,
            "model": self._req.model,
        }

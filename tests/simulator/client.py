"""Plain HTTP helpers for the tests that talk to in-process simulated workers."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

__all__ = ["post", "sse"]


async def post(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def sse(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> list[Any]:
    """The decoded `data:` events of a stream, `[DONE]` as the string."""
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = await response.text()
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events

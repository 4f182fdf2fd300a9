"""Fixtures for the gateway tests: fake workers and a gateway app, all on 127.0.0.1 port 0."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from gateway.app import DEPS, create_app
from gateway.deps import Deps
from gateway.settings import Settings
from tests.gateway.fake_decision import FakeDecision
from tests.support.fake_openai import MODEL, FakeWorker

__all__ = ["MODEL", "Reply", "Stack", "StackFactory"]


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any = None
    events: list[Any] = field(default_factory=list)
    raw: bytes = b""

    @property
    def path(self) -> str:
        return self.headers.get("X-PPD-Path", "")

    @property
    def reason(self) -> str:
        return self.headers.get("X-PPD-Reason", "")

    @property
    def text(self) -> str:
        if self.events:
            parts = []
            for e in self.events:
                if isinstance(e, dict):
                    for c in e.get("choices", []):
                        parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
            return "".join(parts)
        choice = self.body["choices"][0]
        return str(choice.get("message", {}).get("content") or choice.get("text"))


@dataclass
class Stack:
    server: TestServer
    workers: dict[str, FakeWorker]
    http: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def deps(self) -> Deps:
        return self.server.app[DEPS]

    async def post(
        self, path: str, body: Any, *, headers: Mapping[str, str] | None = None, raw: bytes | None = None
    ) -> Reply:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.http.post(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        ) as resp:
            payload = await resp.read()
            reply = Reply(resp.status, dict(resp.headers), raw=payload)
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                for block in payload.decode().split("\n\n"):
                    if block.startswith("data: "):
                        data_s = block[6:]
                        reply.events.append(data_s if data_s == "[DONE]" else json.loads(data_s))
            else:
                try:
                    reply.body = json.loads(payload)
                except ValueError:
                    reply.body = payload
            return reply

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        stream: bool = False,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> Reply:
        body = {"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 4, **extra}
        return await self.post("/v1/chat/completions", body, headers=headers)


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    started: list[Stack] = []

    async def factory(roles: Mapping[str, str] | None = None, **settings: Any) -> Stack:
        roles = roles or {"P0": "prefill", "P1": "prefill", "D0": "decode", "D1": "decode"}
        workers = {wid: await FakeWorker(wid, role).start() for wid, role in roles.items()}
        config: dict[str, Any] = {
            "mode": "local",
            "workers": [{"id": w.id, "role": w.role, "url": w.url} for w in workers.values()],
            "pool": {"health_interval_s": 3600.0},
            "sessions": {"sweep_interval_s": 3600.0},
        }
        for key, value in settings.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            else:
                config[key] = value
        server = TestServer(create_app(Settings.from_mapping(config)), host="127.0.0.1", port=0)
        await server.start_server()
        stack = Stack(server, workers, aiohttp.ClientSession())
        started.append(stack)
        return stack

    yield factory
    for stack in started:
        await stack.http.close()
        await stack.server.close()
        for w in stack.workers.values():
            await w.close()


@pytest.fixture
async def decision() -> AsyncIterator[FakeDecision]:
    """A fake DecisionService on 127.0.0.1:0 (``fake_decision.py``); test_e2e.py has its own, real one."""
    svc = await FakeDecision().start()
    yield svc
    await svc.stop()


def follow_up(messages: list[dict[str, Any]], reply: Reply, text: str) -> None:
    """The next turn of a conversation: the answer as the assistant's message, then ``text``."""
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": text}]

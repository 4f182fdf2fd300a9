"""A controllable DecisionService on 127.0.0.1:0 (grpc.aio, real health service) for the gateway's
decision-client tests. It speaks only the public proto; it is not the real service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from ppd.decision.v1 import decision_pb2, decision_pb2_grpc

SERVICE = "ppd.decision.v1.DecisionService"


@dataclass
class FakeDecision(decision_pb2_grpc.DecisionServiceServicer):
    decision: int = decision_pb2.DECISION_LOCAL
    reason: int = decision_pb2.REASON_TABLE
    alternative_allowed: bool = False
    delay_s: float = 0.0
    abort_code: grpc.StatusCode | None = None
    # Trailing metadata of the abort (the real service's no-table signal: ppd/decision/v1/status.py).
    abort_trailing: tuple[tuple[str, str], ...] = ()
    # RouteStream: the next `break_streams` requests end their stream UNAVAILABLE unanswered, with no
    # cause (what a client sees when a stream's connection or proxy breaks); counted in `broken`.
    break_streams: int = 0
    broken: int = 0
    seen: list[decision_pb2.RouteRequest] = field(default_factory=list)
    # The RPC ("Route" or "RouteStream") that answered each request in `seen`.
    methods: list[str] = field(default_factory=list)
    server: grpc.aio.Server | None = None
    health: HealthServicer | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _answer(
        self, request: decision_pb2.RouteRequest, method: str = "Route"
    ) -> decision_pb2.RouteResponse:
        self.seen.append(request)
        self.methods.append(method)
        return decision_pb2.RouteResponse(
            decision=self.decision,  # type: ignore[arg-type]
            reason=self.reason,  # type: ignore[arg-type]
            table_version="v-test",
            table_key="1P3D/llama-3.1-8b",
            request_id=request.request_id,
            score=0.5,
            alternative_allowed=self.alternative_allowed,
        )

    async def Route(
        self, request: decision_pb2.RouteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> decision_pb2.RouteResponse:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.abort_code is not None:
            await context.abort(self.abort_code, "no table loaded yet", self.abort_trailing)
        return self._answer(request)

    async def RouteStream(
        self,
        request_iterator: AsyncIterator[decision_pb2.RouteRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[decision_pb2.RouteResponse]:
        async for request in request_iterator:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.break_streams:
                self.break_streams -= 1
                self.broken += 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "stream broken")
            if self.abort_code is not None:  # ends the stream, as a service without per-item errors would
                await context.abort(self.abort_code, "no table loaded yet", self.abort_trailing)
            yield self._answer(request, "RouteStream")

    async def RouteBatch(
        self, request: decision_pb2.RouteBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> decision_pb2.RouteBatchResponse:
        return decision_pb2.RouteBatchResponse(
            responses=[self._answer(r, "RouteBatch") for r in request.requests]
        )

    async def DescribeTable(
        self, request: decision_pb2.DescribeTableRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> decision_pb2.DescribeTableResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the fake")
        raise AssertionError  # abort raises

    async def start(self, *, serving: bool = True) -> FakeDecision:
        self.server = grpc.aio.server()
        decision_pb2_grpc.add_DecisionServiceServicer_to_server(self, self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        await self.set_serving(serving)
        return self

    async def set_serving(self, serving: bool) -> None:
        assert self.health is not None
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(SERVICE, status)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

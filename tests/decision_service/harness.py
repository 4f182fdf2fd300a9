"""The in-process harness: a real grpc.aio server on 127.0.0.1:0 over a temp tables directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace

from decision_service.holder import TableHolder
from decision_service.metrics import DecisionMetrics
from decision_service.server import DecisionServer, build_server
from decision_service.settings import Settings
from ppd.decision.v1 import decision_pb2 as pb
from ppd.decision.v1 import decision_pb2_grpc as pb_grpc


@dataclass
class Running:
    server: DecisionServer
    holder: TableHolder
    metrics: DecisionMetrics
    channel: grpc.aio.Channel
    stub: pb_grpc.DecisionServiceAsyncStub
    tables_dir: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


async def start_server(
    tables_dir: Path,
    *,
    default_key: str | None = None,
    tracer: trace.Tracer | None = None,
    **settings_fields: Any,
) -> Running:
    """A started server; `settings_fields` override other `Settings` fields (limits, keepalive);
    `tracer` traces its Route calls."""
    metrics = DecisionMetrics()
    holder = TableHolder(tables_dir, default_key=default_key, listener=metrics)
    await holder.refresh()
    settings = Settings(
        tables_dir=tables_dir, host="127.0.0.1", port=0, default_key=default_key, **settings_fields
    )
    server = build_server(settings, holder, metrics, tracer=tracer)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.DecisionServiceStub(channel)
    return Running(server, holder, metrics, channel, stub, tables_dir)


def turn2(**fields: object) -> pb.RouteRequest:
    """A valid Turn-2 request; keyword arguments override its fields."""
    values: dict[str, object] = {
        "request_id": "req-1",
        "turn": 2,
        "new_input_tokens": 256,
        "expected_output_tokens": 64,
        "context_tokens": 1500,
        "qps": 4.0,
    }
    values.update(fields)
    return pb.RouteRequest(**values)  # type: ignore[arg-type]

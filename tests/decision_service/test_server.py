"""Health transitions and server reflection of a real in-process server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from decision_service.metrics import DecisionMetrics
from decision_service.server import SERVICE_NAME, build_server
from decision_service.settings import Settings
from tests.decision_service.harness import Running, start_server, turn2
from tests.decision_service.tables import DEFAULT_KEY, OTHER_KEY, write_table_file
from tests.support.polling import eventually

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(running: Running, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(running.channel)
    response: health_pb2.HealthCheckResponse = await stub.Check(
        health_pb2.HealthCheckRequest(service=service)
    )
    return int(response.status)


async def test_not_serving_until_the_first_table_loads(empty_server: Running) -> None:
    assert await health_of(empty_server, "") == NOT_SERVING
    assert await health_of(empty_server, SERVICE_NAME) == NOT_SERVING
    write_table_file(empty_server.tables_dir / "a.ppdt", key=DEFAULT_KEY)
    await empty_server.holder.refresh()
    assert await health_of(empty_server, "") == SERVING
    assert await health_of(empty_server, SERVICE_NAME) == SERVING


async def test_not_serving_again_when_the_last_table_goes(running: Running) -> None:
    assert await health_of(running, "") == SERVING
    for path in running.tables_dir.iterdir():
        path.unlink()
    await running.holder.refresh()
    assert await health_of(running, "") == NOT_SERVING


async def test_graceful_shutdown_turns_not_serving_before_the_port_closes(running: Running) -> None:
    stub = health_pb2_grpc.HealthStub(running.channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    first = await watch.read()
    assert isinstance(first, health_pb2.HealthCheckResponse)
    assert first.status == SERVING
    stopping = asyncio.create_task(running.server.stop(5.0))
    second = await watch.read()
    assert isinstance(second, health_pb2.HealthCheckResponse)
    assert second.status == NOT_SERVING
    watch.cancel()
    await stopping


async def test_reflection_lists_the_services(running: Running) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    response = await call.read()
    await call.done_writing()
    assert isinstance(response, reflection_pb2.ServerReflectionResponse)
    names = {service.name for service in response.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_a_second_server_on_a_busy_port_fails(running: Running) -> None:
    settings = Settings(tables_dir=running.tables_dir, port=running.server.port)
    with pytest.raises(OSError, match=f"cannot bind gRPC to 127.0.0.1:{running.server.port}"):
        build_server(settings, running.holder, DecisionMetrics())


async def test_watch_loop_and_health_follow_a_new_file(empty_server: Running) -> None:
    stop = asyncio.Event()
    watcher = asyncio.create_task(empty_server.holder.watch(0.01, stop))
    write_table_file(empty_server.tables_dir / "a.ppdt", key=DEFAULT_KEY)

    async def serving() -> bool:
        status: int = await health_of(empty_server, "")
        return bool(status == SERVING)

    await eventually(serving)
    stop.set()
    await watcher


async def test_deleting_the_implicit_default_is_not_serving_and_never_re_points(loaded_dir: Path) -> None:
    write_table_file(loaded_dir / "2p2d.ppdt", key=OTHER_KEY)
    served = await start_server(loaded_dir)  # no default key: 1P3D (first in sorted order) is pinned
    try:
        assert (await served.stub.Route(turn2())).table_key == DEFAULT_KEY
        (loaded_dir / "1p3d.ppdt").unlink()
        await served.holder.refresh()
        assert await health_of(served, "") == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await served.stub.Route(turn2())
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert DEFAULT_KEY in (caught.value.details() or "")
        assert (await served.stub.Route(turn2(table_key=OTHER_KEY))).table_key == OTHER_KEY
        write_table_file(loaded_dir / "1p3d.ppdt", key=DEFAULT_KEY)
        await served.holder.refresh()
        assert await health_of(served, "") == SERVING
        assert (await served.stub.Route(turn2())).table_key == DEFAULT_KEY
    finally:
        await served.channel.close()
        await served.server.stop(None)

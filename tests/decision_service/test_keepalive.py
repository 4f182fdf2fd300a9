"""The gateway's keepalive and the server's ping policy agree: an idle channel stays READY.

The gateway's channel (`gateway.decision_client.channel_options`) pings on a timer, with a health Watch
open and nothing else happening; the server must not count those pings as abuse (GOAWAY
too_many_pings, the channel drops to IDLE and the Watch ends). Both intervals are scaled down here
(the server accepts a ping every 50 ms, the client sends one every 200 ms, as 5 s and 10 s in
production), and the control case shows the test sees a GOAWAY when the two disagree.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decision_service.server import server_options
from decision_service.settings import Settings
from gateway.decision_client import KEEPALIVE_TIME_MS, channel_options
from tests.decision_service.harness import start_server
from tests.support.polling import eventually

CLIENT_PING_MS = 200
READY = grpc.ChannelConnectivity.READY


async def _idle_gateway_channel(
    target: str,
) -> tuple[grpc.aio.Channel, grpc.aio.UnaryStreamCall[object, object]]:
    """The gateway's channel options with a short ping interval, and a health Watch held open (as the
    gateway holds one), READY once the first answer arrived."""
    channel = grpc.aio.insecure_channel(
        target,
        options=channel_options("pick_first", keepalive_time_ms=CLIENT_PING_MS, keepalive_timeout_ms=20_000),
    )
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    first = await watch.read()
    assert isinstance(first, health_pb2.HealthCheckResponse)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    assert channel.get_state() == READY
    return channel, watch


async def test_an_idle_channel_stays_ready_past_many_keepalive_pings(loaded_dir: Path) -> None:
    served = await start_server(loaded_dir, keepalive_min_ping_interval_s=0.05)
    channel, watch = await _idle_gateway_channel(served.target)
    try:
        left_ready = asyncio.ensure_future(channel.wait_for_state_change(READY))
        # Ten ping intervals; with the old policy the third ping got GOAWAY (after about 0.6 s).
        done, _ = await asyncio.wait({left_ready}, timeout=10 * CLIENT_PING_MS / 1000)
        assert not done, f"the channel left READY: {channel.get_state()}"
        assert not watch.done()
        left_ready.cancel()
    finally:
        watch.cancel()
        await channel.close()
        await served.channel.close()
        await served.server.stop(None)


async def test_control_a_server_stricter_than_the_client_sends_goaway(loaded_dir: Path) -> None:
    served = await start_server(loaded_dir, keepalive_min_ping_interval_s=5.0)
    channel, watch = await _idle_gateway_channel(served.target)
    try:

        async def dropped() -> bool:
            return watch.done() and channel.get_state() != READY

        await eventually(dropped)
        assert await watch.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        watch.cancel()
        await channel.close()
        await served.channel.close()
        await served.server.stop(None)


def test_production_defaults_agree() -> None:
    options = dict(server_options(Settings()))
    assert options["grpc.keepalive_permit_without_calls"] == 1
    # The client pings at least twice as slowly as the server allows, so jitter never earns a strike.
    assert 2 * options["grpc.http2.min_ping_interval_without_data_ms"] <= KEEPALIVE_TIME_MS
    client = dict(channel_options("round_robin"))
    assert client["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    assert client["grpc.keepalive_permit_without_calls"] == 1

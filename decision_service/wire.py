"""Where the DecisionService meets the wire: what grpc.aio does with bad frames, made explicit.

The generated `add_DecisionServiceServicer_to_server` lets grpc.aio parse each request with
`FromString`: a frame that does not parse escapes as an exception, is logged by grpc with a full
traceback at ERROR for every call, and is answered UNKNOWN (a whole RouteStream ends on one corrupt
frame). Its unary handlers read one message and answer OK whatever follows it, and wait for ever when
none comes. So the service registers its methods through this module instead:

- every frame is parsed by `lenient`, which turns a parse error into a `Malformed` value;
- a unary method is registered as client-streaming and wrapped by `exactly_one`: one well-formed message
  goes to the handler; a malformed one, none, or more than one is answered INVALID_ARGUMENT;
- the stream handler receives `Malformed` items like any other and answers each with an error item,
  so the stream stays open (the proto's contract);
- each such client error is reported to the caller's `refused` hook (the servicer logs it through a
  `ppd.rate_limited_log.RateLimitedLog`, one WARNING line at most every 10 s, never a traceback,
  and counts it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

__all__ = ["Malformed", "exactly_one", "lenient"]

_M = TypeVar("_M", bound=Message)
_Req = TypeVar("_Req", bound=Message)
_Resp = TypeVar("_Resp", bound=Message)


class Malformed:
    """A request frame that is not a valid `type_name` message."""

    __slots__ = ("error", "type_name")

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error

    def describe(self) -> str:
        return f"malformed {self.type_name} message: {self.error}"


def lenient(message_type: type[_M]) -> Callable[[bytes], _M | Malformed]:
    """A request deserializer that never raises: a frame that does not parse becomes `Malformed`."""
    parse = message_type.FromString
    name = message_type.DESCRIPTOR.full_name

    def deserialize(raw: bytes) -> _M | Malformed:
        try:
            return parse(raw)
        except DecodeError as exc:
            return Malformed(name, str(exc) or "wire format is corrupt")

    return deserialize


def exactly_one(
    method_name: str,
    handler: Callable[[_Req, grpc.aio.ServicerContext[_Req, _Resp]], Awaitable[_Resp]],
    refused: Callable[[str, str], None],
) -> Callable[[AsyncIterator[_Req | Malformed], grpc.aio.ServicerContext[_Req, _Resp]], Awaitable[_Resp]]:
    """A client-streaming handler that hands exactly one well-formed message to the unary `handler`.

    Anything else is answered INVALID_ARGUMENT after `refused(peer, why)` (log it, count it).
    """

    async def one(
        requests: AsyncIterator[_Req | Malformed], context: grpc.aio.ServicerContext[_Req, _Resp]
    ) -> _Resp:
        request: _Req | None = None
        async for item in requests:
            if isinstance(item, Malformed):
                await _refuse(context, refused, item.describe())
            if request is not None:
                await _refuse(context, refused, f"{method_name} is unary: it got more than one message")
            request = item
        if request is None:
            await _refuse(context, refused, f"{method_name} is unary: it got no request message")
        return await handler(request, context)

    return one


async def _refuse(
    context: grpc.aio.ServicerContext[Any, Any], refused: Callable[[str, str], None], why: str
) -> NoReturn:
    refused(context.peer(), why)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
    raise AssertionError("abort() returned")  # pragma: no cover

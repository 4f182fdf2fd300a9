"""Type aliases shared by the gateway's modules."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = ["Clock", "Endpoint", "Json", "JsonObject", "Path", "Role"]

# Seconds from a monotonic source; injected so that the pure core never reads a clock itself.
Clock = Callable[[], float]
Json = Any
JsonObject = dict[str, Any]
ReadonlyJsonObject = Mapping[str, Any]
# Where a request's prefill ran: through a prefill worker, on the decode worker, or on a replica;
# "bidir": P pulled the history's KV from D, appended, and D pulled the result back (vLLM 3.4).
Path = Literal["pd", "local", "replica", "bidir"]
Role = Literal["prefill", "decode", "replica"]
Endpoint = Literal["chat", "completions"]

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
# Where a request's prefill ran: through a prefill worker, on the decode worker, on a prefill worker that
# pulled the history's KV from the decode worker (vLLM's bidirectional KV mode), or on a replica.
Path = Literal["pd", "local", "bidir", "replica"]
Role = Literal["prefill", "decode", "replica"]
Endpoint = Literal["chat", "completions"]

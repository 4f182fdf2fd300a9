"""Fault-injection settings of one worker (pure values; the server applies them).

Fields (all optional in `POST /admin/faults`; a POST changes only the keys it names):
- `error_rate` (0..1): share of generation requests answered with vLLM's HTTP 500 body.
- `error_seed` (int >= 0, optional): a POST naming it restarts the error draws from this seed, so a
  test sees the same failing requests whatever ran on the worker before.
- `added_latency_ms` (>= 0): delay before a request to a model route is handled.
- `down` (bool): the worker closes its port and drops open connections, like a crashed process;
  `down_for_s` (> 0, optional) reopens it after that many seconds.
- `down_after_requests` (int >= 0): the port closes once that many more generation requests have arrived.
- `refuse_connections` (bool): every request except `/admin/faults` gets its connection reset, no reply.
- `lease_expiry_s` (>= 0): a prefill worker pins KV blocks this long instead of `kv_lease_duration`
  (0 = leases are already expired when a decode worker comes to read them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simulator.core.api_error import ApiError

__all__ = ["Faults"]


def _number(raw: Mapping[str, Any], key: str, *, low: float, high: float = math.inf) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"{key} must be a number in [{low}, {high}]", param=key)
    return float(value)


def _count(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, f"{key} must be an integer >= 0", param=key)
    return value


@dataclass(frozen=True, slots=True)
class Faults:
    error_rate: float = 0.0
    error_seed: int | None = None
    added_latency_ms: float = 0.0
    down: bool = False
    down_for_s: float | None = None
    down_after_requests: int | None = None
    refuse_connections: bool = False
    lease_expiry_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be in [0, 1]")
        if self.added_latency_ms < 0:
            raise ValueError("added_latency_ms must be >= 0")
        if self.down_after_requests is not None and self.down_after_requests < 0:
            raise ValueError("down_after_requests must be >= 0")
        if self.lease_expiry_s is not None and self.lease_expiry_s < 0:
            raise ValueError("lease_expiry_s must be >= 0")
        if self.down_for_s is not None and self.down_for_s <= 0:
            raise ValueError("down_for_s must be > 0")
        if self.error_seed is not None and self.error_seed < 0:
            raise ValueError("error_seed must be >= 0")

    def updated(self, raw: object) -> Faults:
        """These faults with the keys of a JSON object applied; `ApiError` 400 on anything invalid.

        A key set to null resets that fault to its default.
        """
        if not isinstance(raw, Mapping):
            raise ApiError(400, "faults must be a JSON object")
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ApiError(
                400, f"unknown fault keys: {', '.join(unknown)}; known: {', '.join(sorted(names))}"
            )
        changes: dict[str, Any] = {}
        defaults = Faults()
        for key in raw:
            if raw[key] is None:
                changes[key] = getattr(defaults, key)
        for key in ("down", "refuse_connections"):
            if raw.get(key) is not None:
                if not isinstance(raw[key], bool):
                    raise ApiError(400, f"{key} must be a boolean", param=key)
                changes[key] = raw[key]
        bounds = {"error_rate": (0.0, 1.0), "added_latency_ms": (0.0, 3_600_000.0)}
        bounds |= {"lease_expiry_s": (0.0, math.inf), "down_for_s": (0.001, math.inf)}
        for key, (low, high) in bounds.items():
            value = _number(raw, key, low=low, high=high)
            if value is not None:
                changes[key] = value
        for key in ("error_seed", "down_after_requests"):
            count = _count(raw, key)
            if count is not None:
                changes[key] = count
        return dataclasses.replace(self, **changes)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

"""Timed drift of a simulated cluster: the hardware changes under a running workload (pure values).

A :class:`DriftEvent` says that from virtual time ``at_s`` on, the KV links move ``link`` times their
configured bandwidth and the decode (prefill) workers' steps take ``decode`` (``prefill``) times their
profile's time. Factors are relative to the configured cluster, not to the previous event, and
``None`` leaves that part as it is: ``DriftEvent(at_s=60, link=0.1)`` drops every P->D link to a tenth
at 60 s; a later ``DriftEvent(at_s=120, link=1.0)`` restores it. The cluster applies an event at its
time (``simulator.core.cluster``, ``ClusterConfig.drift``): a transfer under way continues at the new
bandwidth (shared-link mode; in the async and blocking modes a transfer keeps the time it was given
when it started), and a step that is running ends as planned, the next one is priced anew. A workload
mix that shifts needs no event: concatenate conversation lists with later start times.

A slower worker is its profile with the hardware rates divided and the CPU times multiplied by the
factor (:func:`slowed`): every term of the step cost model is linear in those, so each step takes
exactly ``factor`` times as long.

The text form (``parse_drift``, for command lines): ``AT:KEY=FACTOR[,KEY=FACTOR...]`` with keys
``link``, ``decode``, ``prefill``, e.g. ``60:link=0.1,decode=2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.core.profile import Profile

__all__ = ["DriftError", "DriftEvent", "parse_drift", "slowed"]

_KEYS = ("link", "decode", "prefill")


class DriftError(ValueError):
    """A drift event that cannot happen (negative time, a factor that is not a positive number)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftEvent:
    at_s: float
    #: KV link bandwidth, as a factor of the configured link's (0.1 = ten times slower).
    link: float | None = None
    #: Decode workers' step time, as a factor of the profile's (2 = twice as slow).
    decode: float | None = None
    #: Prefill workers' step time, as a factor of the profile's.
    prefill: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise DriftError(f"a drift event needs a time >= 0, got {self.at_s}")
        for key in _KEYS:
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise DriftError(f"drift factor {key} must be a positive number, got {value}")
        if all(getattr(self, key) is None for key in _KEYS):
            raise DriftError(
                f"the drift event at {self.at_s:g} s changes nothing (set link, decode or prefill)"
            )

    def describe(self) -> str:
        parts = []
        if self.link is not None:
            parts.append(f"KV links x{self.link:g} bandwidth")
        if self.decode is not None:
            parts.append(f"decode steps x{self.decode:g} time")
        if self.prefill is not None:
            parts.append(f"prefill steps x{self.prefill:g} time")
        return f"at {self.at_s:g} s: " + ", ".join(parts)


def parse_drift(text: str) -> DriftEvent:
    """``60:link=0.1,decode=2`` -> ``DriftEvent(at_s=60, link=0.1, decode=2)``; DriftError when malformed."""
    at, sep, rest = text.partition(":")
    if not sep or not rest.strip():
        raise DriftError(f"expected AT:KEY=FACTOR[,KEY=FACTOR...] (keys {', '.join(_KEYS)}), got {text!r}")
    factors: dict[str, float] = {}
    try:
        at_s = float(at)
        for item in rest.split(","):
            key, eq, value = item.strip().partition("=")
            if not eq or key not in _KEYS:
                raise DriftError(f"unknown drift key in {item.strip()!r} (known: {', '.join(_KEYS)})")
            if key in factors:
                raise DriftError(f"drift key {key} given twice in {text!r}")
            factors[key] = float(value)
    except ValueError as exc:
        if isinstance(exc, DriftError):
            raise
        raise DriftError(f"not a number in drift event {text!r}") from None
    return DriftEvent(at_s=at_s, **factors)


def slowed(profile: Profile, factor: float) -> Profile:
    """``profile`` on hardware ``factor`` times slower: each step of its cost model takes ``factor``
    times as long (``factor`` < 1: faster)."""
    if factor == 1.0:
        return profile
    hw, cpu = profile.hardware, profile.cpu
    return profile.with_overrides(
        {
            "hardware.flops_per_s": hw.flops_per_s / factor,
            "hardware.hbm_bytes_per_s": hw.hbm_bytes_per_s / factor,
            "cpu.step_s": cpu.step_s * factor,
            "cpu.per_sampled_request_s": cpu.per_sampled_request_s * factor,
            "cpu.frontend_per_token_s": cpu.frontend_per_token_s * factor,
            "cpu.layer_floor_s": cpu.layer_floor_s * factor,
        }
    )

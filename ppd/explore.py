"""Exploration in ``ppd`` mode: a share ε of Turn 2+ requests takes the path the table did not choose,
so the request log shows both paths and a table refresh can see when the other one became better.

Shared by the gateway (live) and the virtual-time simulator: pure, no clock reads (``now`` is an
argument), no shared random generator.

Rules:

1. The draw is a seeded hash (BLAKE2b-64 of ``seed`` and ``request_key``) mapped into [0, 1): the same
   request explores or not whatever the order requests arrive in, run after run. It explores when the
   draw is below ε. The seed is secret where clients could exploit knowing it (they choose their
   session ids, so with a known seed they choose which of their turns explore): ``seed`` unset
   (None) means the policy's ``default_seed``, which the gateway draws at random per process
   (``secret_seed``) and the virtual-time simulator leaves at 0, so its runs stay reproducible; a
   seed set in the settings is used as is (reproducible experiments).
2. Bounds on the harm; a request outside them is not eligible and takes the chosen path (propensity 1):
   - never into a path whose cell fails the table's success SLO (``alternative_allowed`` is False:
     the decision core says so, and says False for turn 1 and for cells without measurements);
   - never while a live-signal guard is active (``guard_active``: the decode-load or KV guard fired);
   - at most ``max_per_worker_per_s`` explorations per worker: a token bucket per worker that refills
     at that rate and holds at most ``max(1, rate)`` (0: never). A request that finds the bucket empty
     is not eligible, so the bucket is checked before the draw and spent only by a request that
     explores.
3. ``propensity`` is P(path taken | chosen path, state): ε for an explored request, 1 - ε for an
   eligible one that took the chosen path, 1.0 for one that was not eligible. ε = 0 never explores
   and always answers propensity 1.0 (nothing else changes: no bucket is touched).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass

__all__ = ["Exploration", "ExplorationPolicy", "ExploreSettings", "explore_draw", "secret_seed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ExploreSettings:
    """ε (share of eligible Turn 2+ requests that explore, 0..1; 0 = off), the draw's seed (None: not
    set, rule 1), and the cap on explorations per worker and second. Raises ``ValueError`` naming a
    bad value."""

    epsilon: float = 0.0
    seed: int | None = None
    max_per_worker_per_s: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and 0.0 <= self.epsilon <= 1.0):
            raise ValueError(f"explore epsilon must be within 0..1, got {self.epsilon!r}")
        if self.seed is not None and (type(self.seed) is not int or self.seed < 0):
            raise ValueError(f"explore seed must be an integer >= 0, got {self.seed!r}")
        rate = self.max_per_worker_per_s
        if not (math.isfinite(rate) and rate >= 0.0):
            raise ValueError(f"explore max_per_worker_per_s must be a finite number >= 0, got {rate!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Exploration:
    """What to do with one request: ``local`` is the path to take; ``explored`` says it is not the
    chosen one; ``propensity`` is the probability of the path taken given the chosen path (rule 3)."""

    explored: bool
    local: bool
    propensity: float


def secret_seed() -> int:
    """Rule 1: a seed no client can know (64 random bits from the OS)."""
    return secrets.randbits(64)


def explore_draw(seed: int, request_key: str) -> float:
    """Rule 1: the request's place in [0, 1)."""
    digest = hashlib.blake2b(f"{seed}:{request_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class _Bucket:
    __slots__ = ("at", "tokens")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at


class ExplorationPolicy:
    """Rules 1-3 for one gateway or one simulated cluster (the buckets are its only state)."""

    __slots__ = ("_buckets", "_burst", "_seed", "_settings")

    def __init__(self, settings: ExploreSettings, *, default_seed: int = 0) -> None:
        """``default_seed``: the seed when ``settings.seed`` is not set (rule 1)."""
        self._settings = settings
        self._seed = settings.seed if settings.seed is not None else default_seed
        rate = settings.max_per_worker_per_s
        self._burst = max(1.0, rate) if rate > 0 else 0.0
        self._buckets: dict[str, _Bucket] = {}

    @property
    def settings(self) -> ExploreSettings:
        return self._settings

    def decide(
        self,
        *,
        request_key: str,
        chosen_local: bool,
        alternative_allowed: bool,
        worker: str,
        now: float,
        guard_active: bool,
    ) -> Exploration:
        """The path for one Turn 2+ request whose table verdict is ``chosen_local``."""
        eps = self._settings.epsilon
        if eps <= 0.0 or not alternative_allowed or guard_active or not self._has_token(worker, now):
            return Exploration(explored=False, local=chosen_local, propensity=1.0)
        if explore_draw(self._seed, request_key) < eps:
            self._buckets[worker].tokens -= 1.0
            return Exploration(explored=True, local=not chosen_local, propensity=eps)
        return Exploration(explored=False, local=chosen_local, propensity=1.0 - eps)

    def _has_token(self, worker: str, now: float) -> bool:
        """Refill ``worker``'s bucket up to ``now`` (time never runs back here) and say whether it
        holds a whole token."""
        bucket = self._buckets.get(worker)
        if bucket is None:
            bucket = self._buckets[worker] = _Bucket(self._burst, now)
        elif now > bucket.at:
            rate = self._settings.max_per_worker_per_s
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) * rate)
            bucket.at = now
        return bucket.tokens >= 1.0

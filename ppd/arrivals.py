"""Poisson arrivals: the one definition every load source uses (load generator, simulator, sweeps).

Pure: the caller owns the seeded ``random.Random``, so the same generator state always gives the same
offsets, byte for byte. How the generator is seeded is the caller's (and stays as it was): the load
generator seeds with ``f"arrivals:{seed}"``, the simulator's workloads with the integer seed.
"""

from __future__ import annotations

import random

__all__ = ["poisson_arrivals"]


def poisson_arrivals(rng: random.Random, qps: float, duration_s: float) -> list[float]:
    """Arrival offsets (s) of a Poisson process of rate ``qps`` on [0, duration_s).

    The gaps are ``rng.expovariate(qps)`` drawn one after another; the first arrival is one gap after 0.
    ``ValueError`` when ``qps`` is not positive (``expovariate`` would never end or divide by zero).
    """
    if not qps > 0:
        raise ValueError("qps must be positive")
    times: list[float] = []
    t = rng.expovariate(qps)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(qps)
    return times

"""Invariants of the engine under random traffic (hypothesis): blocks are conserved, every request ends
with the tokens it asked for, and fast-forward never changes a time, even under preemption."""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from simulator.core.engine import Engine, EngineConfig, EngineRequest
from simulator.core.profile import load_profile
from simulator.core.virtual import run_engine

PROFILE = load_profile()

request = st.tuples(
    st.floats(min_value=0.0, max_value=0.5),  # arrival
    st.integers(min_value=0, max_value=3),  # stream: a few shared ones, so prefix hits happen
    st.integers(min_value=1, max_value=700),  # prompt tokens
    st.integers(min_value=1, max_value=120),  # max_tokens
    st.one_of(st.none(), st.integers(min_value=1, max_value=120)),  # natural stop
)


def _arrivals(spec: list[tuple[float, int, int, int, int | None]]) -> list[tuple[float, EngineRequest]]:
    return [
        (t, EngineRequest.from_stream(f"r{i}", stream, n, max_tokens=m, eos_at=eos))
        for i, (t, stream, n, m, eos) in enumerate(spec)
    ]


@settings(max_examples=60, deadline=None)
@given(
    spec=st.lists(request, min_size=1, max_size=25), capacity_blocks=st.integers(min_value=40, max_value=400)
)
def test_random_traffic_conserves_blocks_and_matches_fast_forward(
    spec: list[tuple[float, int, int, int, int | None]], capacity_blocks: int
) -> None:
    capacity = capacity_blocks * 16
    assume(all(n < capacity for _, _, n, _, _ in spec))
    slow_engine = Engine(PROFILE, EngineConfig(kv_capacity_tokens=capacity, max_num_batched_tokens=1024))
    fast_engine = Engine(
        PROFILE,
        EngineConfig(
            kv_capacity_tokens=capacity, max_num_batched_tokens=1024, fast_forward=True, record_sampled=False
        ),
    )
    slow = run_engine(slow_engine, _arrivals(spec))
    fast = run_engine(fast_engine, _arrivals(spec))
    for engine in (slow_engine, fast_engine):
        assert engine.pool.num_free == engine.pool.num_blocks
        assert engine.next_step_at() is None
        assert engine.stats().num_running == 0
    for i, (_, _, n_prompt, max_tokens, eos) in enumerate(spec):
        a, b = slow.requests[f"r{i}"], fast.requests[f"r{i}"]
        assert a.result is not None
        assert b.result is not None
        expected = min(max_tokens if eos is None else min(max_tokens, eos), capacity - n_prompt)
        assert a.result.num_output_tokens == expected
        assert b.result.num_output_tokens == expected
        assert a.finished is not None
        assert b.finished is not None
        assert math.isclose(a.finished, b.finished, rel_tol=1e-9, abs_tol=1e-9)

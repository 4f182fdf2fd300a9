"""The engine core: batching, chunked prefill, prefix cache, preemption, P/D roles, fast-forward."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from simulator.core.engine import Engine, EngineConfig, EngineRequest, FinishReason, KvPullMode, StepResult
from simulator.core.profile import Profile
from simulator.core.virtual import run_engine


def drain(engine: Engine, now: float = 0.0, limit: int = 100_000) -> list[StepResult]:
    out: list[StepResult] = []
    for _ in range(limit):
        t = engine.next_step_at()
        if t is None:
            return out
        r = engine.step(max(now, t))
        now = r.end
        out.append(r)
    raise AssertionError("engine did not go idle")


def req(rid: str, stream: int, n: int, out: int, **kw: object) -> EngineRequest:
    return EngineRequest.from_stream(rid, stream, n, max_tokens=out, **kw)  # type: ignore[arg-type]


def test_continuous_batching_decodes_together(profile: Profile) -> None:
    e = Engine(profile)
    for i in range(3):
        e.add_request(req(f"r{i}", i, 100, 5), 0.0)
    steps = drain(e)
    assert steps[0].first_tokens == ("r0", "r1", "r2")
    assert [s.num_decodes for s in steps[1:]] == [3, 3, 3, 3]
    assert sorted(f.request_id for f in steps[-1].finished) == ["r0", "r1", "r2"]
    assert all(f.reason is FinishReason.LENGTH and f.num_output_tokens == 5 for f in steps[-1].finished)
    assert all(s.end == pytest.approx(n.start) for s, n in itertools.pairwise(steps))
    assert e.next_step_at() is None
    assert e.stats().num_running == 0


def test_chunked_prefill_respects_the_token_budget(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(max_num_batched_tokens=1024))
    e.add_request(req("long", 1, 2500, 2), 0.0)
    e.add_request(req("short", 2, 100, 2), 0.0)
    steps = drain(e)
    chunks = [[(c.request_id, c.n_new, c.n_cached) for c in s.prefills] for s in steps]
    assert chunks[0] == [("long", 1024, 0)]
    assert chunks[1] == [("long", 1024, 1024)]
    # 452 left for the long prompt, then the short one fills the rest of the budget.
    assert chunks[2] == [("long", 452, 2048), ("short", 100, 0)]
    assert steps[2].first_tokens == ("long", "short")


def test_max_num_seqs_holds_requests_back(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(max_num_seqs=2, max_num_batched_tokens=4096))
    for i in range(3):
        e.add_request(req(f"r{i}", i, 50, 3), 0.0)
    first = e.step(0.0)
    assert first.first_tokens == ("r0", "r1")
    assert e.stats().num_waiting == 1
    drain(e, first.end)
    assert e.stats().num_waiting == 0


def test_prefix_hit_is_whole_blocks_capped_below_the_prompt(profile: Profile) -> None:
    e = Engine(profile)
    e.add_request(req("t1", 9, 100, 20, ignore_eos=True), 0.0)
    steps = drain(e)
    # Turn 2 on the same stream: prompt 100 + answer 20 + 40 new tokens.
    e.add_request(req("t2", 9, 160, 1), steps[-1].end)
    s = e.step(steps[-1].end)
    ((chunk,),) = [s.prefills]
    # Cached: 119 tokens of KV (the last answer token has none) -> 7 full blocks = 112 tokens.
    assert (chunk.n_cached, chunk.n_new) == (112, 48)
    st = e.stats()
    assert st.prefix_cache_queries == 260
    assert st.prefix_cache_hits == 112
    # A fully cached prompt still recomputes its last block.
    e.add_request(req("t3", 9, 112, 1), s.end)
    (chunk,) = e.step(s.end).prefills
    assert (chunk.n_cached, chunk.n_new) == (96, 16)


def test_stop_min_tokens_and_ignore_eos(profile: Profile) -> None:
    cases = {
        "natural": (EngineRequest.from_stream("natural", 1, 10, max_tokens=50, eos_at=7), 7, "stop"),
        "capped": (EngineRequest.from_stream("capped", 2, 10, max_tokens=5, eos_at=7), 5, "length"),
        "min": (EngineRequest.from_stream("min", 3, 10, max_tokens=50, eos_at=3, min_tokens=9), 9, "stop"),
        "ignore": (
            EngineRequest.from_stream("ignore", 4, 10, max_tokens=12, eos_at=3, ignore_eos=True),
            12,
            "length",
        ),
    }
    e = Engine(profile)
    for r, _, _ in cases.values():
        e.add_request(r, 0.0)
    done = {f.request_id: f for s in drain(e) for f in s.finished}
    for rid, (_, n, reason) in cases.items():
        assert done[rid].num_output_tokens == n, rid
        assert str(done[rid].reason) == reason, rid


def test_preemption_when_blocks_run_out(profile: Profile) -> None:
    # 20 blocks of 16 tokens: two requests of 100 prompt + 100 output tokens cannot both finish.
    e = Engine(profile, EngineConfig(kv_capacity_tokens=320))
    e.add_request(req("a", 1, 100, 100, ignore_eos=True), 0.0)
    e.add_request(req("b", 2, 100, 100, ignore_eos=True), 0.0)
    steps = drain(e)
    preempted = [p for s in steps for p in s.preempted]
    assert preempted
    assert preempted[0] == "b"
    done = {f.request_id: f.num_output_tokens for s in steps for f in s.finished}
    assert done == {"a": 100, "b": 100}
    assert e.stats().num_preemptions == len(preempted)
    assert e.pool.num_free == e.pool.num_blocks  # every block came back


def test_lru_eviction_keeps_the_engine_going(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(kv_capacity_tokens=16 * 40))
    now = 0.0
    for i in range(30):  # each leaves ~20 cached blocks behind; the pool holds 40
        e.add_request(req(f"r{i}", i, 300, 10), now)
        now = drain(e, now)[-1].end
    assert e.pool.evictions > 0
    assert e.pool.num_free == e.pool.num_blocks


def test_prefill_side_pins_blocks_for_the_lease(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(lease_s=30.0))
    e.add_request(req("p", 1, 500, 64, remote_decode=True), 0.0)
    s = e.step(0.0)
    (fin,) = s.finished
    assert fin.kv_pinned
    assert fin.num_output_tokens == 1
    assert fin.reason is FinishReason.LENGTH
    assert e.stats().num_pinned == 1
    assert e.pool.usage() > 0
    assert e.lease_alive("p", s.end + 29.0)
    assert not e.lease_alive("p", s.end + 30.0)
    assert len(e.remote_block_ids("p")) == 32
    assert e.release("p", s.end + 1.0)
    assert not e.release("p", s.end + 1.0)
    assert e.pool.usage() == 0.0
    assert e.pool.num_cached == 31


def test_lease_expiry_frees_and_counts(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(lease_s=5.0))
    e.add_request(req("p", 1, 500, 1, remote_decode=True), 0.0)
    s = e.step(0.0)
    assert e.extend_lease("p", s.end + 4.0)  # a heartbeat: now runs to s.end + 9
    assert e.next_step_at() == pytest.approx(s.end + 9.0)
    assert e.expire_leases(s.end + 6.0) == []
    assert e.expire_leases(s.end + 9.0) == ["p"]
    assert e.stats().num_kv_expired == 1
    assert e.stats().num_pinned == 0
    assert e.next_step_at() is None


def test_decode_side_pulls_then_recomputes_the_last_token(profile: Profile) -> None:
    e = Engine(profile)
    e.add_request(req("d", 1, 1000, 4, remote_prefill=True), 0.0)
    s = e.step(0.0)
    (pull,) = s.kv_pulls
    assert (pull.n_tokens, pull.n_cached, s.duration) == (1000, 0, 0.0)
    assert e.next_step_at() is None
    assert e.stats().num_waiting_deferred == 1
    assert e.kv_loaded("d", 0.1, stall_s=0.05)
    s = e.step(0.1)
    assert [(c.n_new, c.n_cached) for c in s.prefills] == [(1, 999)]
    assert s.first_tokens == ("d",)
    assert s.stall_s == 0.05
    assert s.duration > 0.05
    steps = drain(e, s.end)
    assert steps[-1].finished[0].num_output_tokens == 4
    st = e.stats()
    assert st.external_prefix_cache_hits == 999
    # As vLLM counts it: every pulled token is external, the recomputed last one included.
    assert st.prompt_tokens_external == 1000
    assert st.prompt_tokens_local_compute == 0


def test_decode_side_pulls_only_uncached_tokens_unless_full(profile: Profile) -> None:
    for mode, expected in ((KvPullMode.UNCACHED, 1000 - 496), (KvPullMode.FULL, 1000)):
        e = Engine(profile, EngineConfig(kv_pull=mode))
        e.add_request(req("warm", 1, 500, 1), 0.0)
        end = drain(e)[-1].end
        e.add_request(req("d", 1, 1000, 4, remote_prefill=True), end)
        (pull,) = e.step(end).kv_pulls
        assert pull.n_tokens == expected


def test_bidirectional_decode_side_keeps_its_blocks_for_the_ttl(profile: Profile) -> None:
    e = Engine(profile)
    e.add_request(replace(req("d", 1, 1000, 40, remote_prefill=True), kv_ttl_s=480.0), 0.0)
    e.step(0.0)
    e.kv_loaded("d", 0.1)
    end = e.step(0.1)
    while not end.finished:
        end = e.step(end.end)
    (fin,) = end.finished
    assert (fin.kv_pinned, fin.reason, fin.num_output_tokens) == (True, FinishReason.LENGTH, 40)
    assert e.stats().num_pinned == 1
    assert e.load() == 0
    assert e.lease_expires_at("d") == pytest.approx(end.end + 480.0)
    assert len(e.remote_block_ids("d")) == -(-(1000 + 40 - 1) // 16)  # prompt + output but the last
    assert e.expire_leases(end.end + 479.0) == []
    assert e.expire_leases(end.end + 480.0) == ["d"]
    assert e.lease_expires_at("d") is None
    assert e.stats().num_kv_expired == 1
    assert e.pool.usage() == 0.0
    assert e.pool.num_cached == (1000 + 40 - 1) // 16  # its output blocks stay in the prefix cache


def test_bidirectional_prefill_side_pulls_the_decoders_prefix(profile: Profile) -> None:
    def p_leg(engine: Engine, remote: int, now: float) -> tuple[int, StepResult]:
        engine.add_request(
            replace(req("p", 1, 1200, 64, remote_decode=True), remote_prefix_tokens=remote), now
        )
        s = engine.step(now)
        pulled = s.kv_pulls[0].n_tokens if s.kv_pulls else 0
        if pulled:
            assert s.kv_pulls[0].n_cached == 496
            assert e.kv_loaded("p", s.end)
            s = engine.step(s.end)
        return pulled, s

    cases = ((1000, 64, 504, 200), (540, 64, 0, 704), (540, 0, 44, 660), (5000, 64, 704, 1))
    for remote, threshold, pull, computed in cases:
        e = Engine(profile, EngineConfig(kv_recompute_threshold=threshold))
        e.add_request(req("warm", 1, 500, 1), 0.0)  # 31 blocks (496 tokens) of the prompt cached here
        pulled, s = p_leg(e, remote, drain(e)[-1].end)
        assert pulled == pull, remote
        assert [c.n_new for c in s.prefills] == [computed]
        (fin,) = s.finished
        assert fin.kv_pinned
        assert fin.num_cached_tokens == 1200 - computed  # local hit + pulled
        assert e.stats().external_prefix_cache_hits == (1200 - 496 - computed if pull else 0)
        assert e.stats().prefix_cache_hits == 496


def test_kv_failure_ends_the_request_with_error(profile: Profile) -> None:
    e = Engine(profile)
    e.add_request(req("d", 1, 1000, 4, remote_prefill=True), 0.0)
    e.step(0.0)
    fin = e.kv_failed("d", 1.0)
    assert fin is not None
    assert fin.reason is FinishReason.ERROR
    assert e.kv_failed("d", 1.0) is None
    assert e.pool.usage() == 0.0
    assert e.next_step_at() is None


def test_kv_recompute_prefills_the_prompt_here_instead(profile: Profile) -> None:
    """vLLM's kv_load_failure_policy=recompute: the failed pull becomes a local prefill past the local hit;
    the prompt counts as computed and cached here, never as transferred."""
    e = Engine(profile)
    e.add_request(req("warm", 1, 500, 1), 0.0)  # 31 blocks (496 tokens) of the prompt cached here
    end = drain(e)[-1].end
    before = e.stats()
    e.add_request(req("d", 1, 1000, 4, remote_prefill=True), end)
    (pull,) = e.step(end).kv_pulls
    assert pull.n_tokens == 1000 - 496
    assert e.kv_recompute("d", end + 1.0)
    assert not e.kv_recompute("d", end + 1.0)  # no longer waiting for KV
    assert e.kv_failed("d", end + 1.0) is None
    steps = drain(e, end + 1.0)
    assert not any(s.kv_pulls for s in steps)
    assert sum(c.n_new for s in steps for c in s.prefills) == 1000 - 496
    (fin,) = steps[-1].finished
    assert (fin.reason, fin.num_output_tokens, fin.num_cached_tokens) == (FinishReason.LENGTH, 4, 496)
    st = e.stats()
    assert st.prompt_tokens_external == 0
    assert st.prompt_tokens_local_compute - before.prompt_tokens_local_compute == 1000 - 496
    assert st.prompt_tokens_local_cache_hit - before.prompt_tokens_local_cache_hit == 496
    assert e.pool.usage() == 0.0


def test_kv_recompute_of_a_bidirectional_prefill_leg_still_pins_its_blocks(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(kv_recompute_threshold=0))
    e.add_request(replace(req("p", 1, 1200, 64, remote_decode=True), remote_prefix_tokens=1000), 0.0)
    (pull,) = e.step(0.0).kv_pulls
    assert pull.n_tokens == 1000
    assert e.kv_recompute("p", 0.5)
    steps = drain(e, 0.5)
    assert sum(c.n_new for s in steps for c in s.prefills) == 1200
    (fin,) = (f for s in steps for f in s.finished)
    assert (fin.kv_pinned, fin.num_output_tokens, fin.num_cached_tokens) == (True, 1, 0)
    assert e.stats().external_prefix_cache_hits == 1000  # the connector's query was answered
    assert e.stats().prompt_tokens_external == 0


def test_a_pull_counts_its_prompt_sources_only_once_the_kv_arrived(profile: Profile) -> None:
    """Like vLLM's prefill stats (reported with the first token): an aborted pull counts no source."""
    e = Engine(profile)
    e.add_request(req("d", 1, 1000, 4, remote_prefill=True), 0.0)
    e.step(0.0)
    assert e.stats().prompt_tokens_external == 0
    assert e.abort("d", 1.0)
    st = e.stats()
    assert (st.prompt_tokens_external, st.prompt_tokens_local_cache_hit) == (0, 0)


def test_abort_anywhere_frees_blocks(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(max_num_seqs=1))
    e.add_request(req("run", 1, 300, 50), 0.0)
    e.add_request(req("wait", 2, 300, 50), 0.0)
    s = e.step(0.0)
    assert e.abort("wait", s.end)
    assert e.abort("run", s.end)
    assert not e.abort("run", s.end)
    assert e.pool.usage() == 0.0
    assert e.next_step_at() is None
    e.add_request(req("x", 1, 10, 1), 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request(req("x", 1, 10, 1), 0.0)


def test_invalid_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt"):
        req("r", 1, 0, 1)
    with pytest.raises(ValueError, match="max_tokens"):
        req("r", 1, 10, 0)
    with pytest.raises(ValueError, match="either"):
        req("r", 1, 10, 1, remote_decode=True, remote_prefill=True)
    with pytest.raises(ValueError, match="P leg"):
        replace(req("r", 1, 10, 1), remote_prefix_tokens=5)
    with pytest.raises(ValueError, match="kv_ttl_s"):
        replace(req("r", 1, 10, 1, remote_decode=True), kv_ttl_s=1.0)


def _arrivals() -> list[tuple[float, EngineRequest]]:
    return [(i * 0.037, req(f"q{i}", i % 7, 200 + 53 * i, 40 + 17 * i, ignore_eos=True)) for i in range(25)]


def test_fast_forward_gives_the_same_times(profile: Profile) -> None:
    slow = run_engine(Engine(profile), _arrivals())
    fast = run_engine(Engine(profile, EngineConfig(fast_forward=True, record_sampled=False)), _arrivals())
    assert len(fast.step_log) < len(slow.step_log) / 3
    for rid, a in slow.requests.items():
        b = fast.requests[rid]
        assert a.first_token is not None
        assert b.first_token is not None
        assert a.finished is not None
        assert b.finished is not None
        assert math.isclose(a.first_token, b.first_token, abs_tol=1e-9)
        assert math.isclose(a.finished, b.finished, abs_tol=1e-9)


def test_virtual_driver_step_log_is_deterministic(profile: Profile) -> None:
    a = run_engine(Engine(profile), _arrivals(), record_tokens=True)
    b = run_engine(Engine(profile), _arrivals(), record_tokens=True)
    assert a.step_log == b.step_log
    entry = a.step_log[0]
    assert set(entry) == {"t", "dt", "n", "decode", "prefill", "first", "finished", "pulls", "preempted"}
    times = a.requests["q3"]
    assert times.first_token == times.token_times[0]
    assert times.finished == times.token_times[-1]
    assert len(times.token_times) == 40 + 17 * 3


def test_cascade_breaks_when_a_foreign_request_runs(profile: Profile) -> None:
    cas = profile.with_overrides({"cascade.enabled": True, "cascade.reread_factor": 1.0})
    e = Engine(cas)
    e.add_request(req("warm", 0, 2048 + 16, 1), 0.0)
    now = drain(e)[-1].end
    # 50 decodes sharing a 2,048-token prefix (stream 0): cascade reads the prefix once.
    for i in range(50):
        e.add_request(req(f"d{i}", 0, 2048 + 8, 100), now)
    now = e.step(now).end
    with_cascade = e.step(now)
    e.add_request(req("foreign", 99, 16, 50), with_cascade.end)
    e.step(with_cascade.end)
    broken = e.step(e.busy_until)
    assert broken.num_decodes == 51
    assert broken.duration > with_cascade.duration * 1.1


def test_a_sequence_longer_than_the_kv_cache_is_capped_or_refused(profile: Profile) -> None:
    e = Engine(profile, EngineConfig(kv_capacity_tokens=640))
    with pytest.raises(ValueError, match="does not fit"):
        e.add_request(req("huge", 1, 640, 1), 0.0)
    e.add_request(req("long", 2, 600, 120, ignore_eos=True), 0.0)
    done = [f for s in drain(e) for f in s.finished]
    assert [(f.request_id, f.num_output_tokens, f.reason) for f in done] == [
        ("long", 40, FinishReason.LENGTH)
    ]
    assert e.pool.num_free == e.pool.num_blocks

"""The placement-cost benchmark at a tiny size: both arms run end to end on the simulated 2P2D cluster
with KV events and print every figure (no speed asserts)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.support.benchmarks import REPO, run_benchmark


@pytest.mark.bench
def test_placement_cost_prints_both_arms_side_by_side_and_the_tokenize_parts() -> None:
    # One conversation at a time: the least-recently-picked P then alternates, so a Turn 2+ whose
    # history is on the other P is placed by its prefix every other turn.
    args = ["--rounds", "1", "--conversations", "4", "--turns", "3", "--streams", "1"]
    args += ["--history-tokens", "128", "--max-tokens", "4", "--tokenize-calls", "5"]
    figures = run_benchmark("benchmarks.placement", args)
    arms = {(f["arm"], f["phase"]): f for f in figures if f["figure"] == "arm"}
    assert set(arms) == {(a, p) for a in ("least_loaded", "prefix") for p in ("turn1", "later")}
    for (_, phase), f in arms.items():
        assert f["requests"] == (4 if phase == "turn1" else 8)
        assert f["sessions_lost"] == 0
        assert f["own_p50_ms"] is not None
        assert f["own_p50_ms"] > 0
        assert f["ttft_p50_ms"] > 0
    # Placement off never asks for the prompt's token ids; on, once per turn (P and D share it).
    assert all(arms["least_loaded", p]["tokenize_per_request"] == 0 for p in ("turn1", "later"))
    # No call: every opening message is new (nothing to place Turn 1 by), and a later turn is placed by
    # the marks of the prompt P returned on the turn before (return_token_ids).
    assert arms["prefix", "turn1"]["tokenize_per_request"] == 0
    assert arms["prefix", "later"]["tokenize_per_request"] == 0
    assert arms["least_loaded", "later"]["prefix_share"]["prefill"] == 0
    assert arms["prefix", "later"]["prefix_share"]["prefill"] > 0
    (summary,) = [f for f in figures if f["figure"] == "summary"]
    for phase in ("turn1", "later"):
        ratios = summary["prefix_vs_least_loaded"][phase]
        assert all(math.isfinite(ratios[k]) and ratios[k] > 0 for k in ("own_p50_ms", "ttft_p50_ms"))
    (tokenize,) = [f for f in figures if f["figure"] == "tokenize"]
    assert tokenize["calls"] == 5
    assert tokenize["prompt_tokens"] >= 128
    assert tokenize["round_trip_p50_ms"] > 0
    assert tokenize["hash_us"] > 0
    (memory,) = [f for f in figures if f["figure"] == "memory"]
    sizes = memory["by_prompt_tokens"]
    assert set(sizes) == {"1024", "8192", "32768"}
    # Bounded whatever the prompt: a few marks more for 32x the tokens, a few hundred bytes each way.
    assert sizes["1024"]["marks"] < sizes["32768"]["marks"] <= sizes["1024"]["marks"] + 5
    assert all(
        0 < s["session_store_bytes"] < 1024 and 0 < s["opening_memory_bytes"] < 4096 for s in sizes.values()
    )


@pytest.mark.bench
def test_in_ppd_mode_both_arms_ask_the_same_tokenize_on_turn_two() -> None:
    args = ["--rounds", "1", "--conversations", "3", "--turns", "2", "--streams", "1", "--mode", "ppd"]
    args += ["--history-tokens", "128", "--max-tokens", "4", "--tokenize-calls", "2"]
    figures = run_benchmark("benchmarks.placement", args)
    arms = {(f["arm"], f["phase"]): f for f in figures if f["figure"] == "arm"}
    assert all(f["sessions_lost"] == 0 for f in arms.values())
    # Turn 2+ asks its D's /tokenize for the residency check either way; placement reuses its ids.
    assert arms["least_loaded", "later"]["tokenize_per_request"] == 1
    assert arms["prefix", "later"]["tokenize_per_request"] == 1
    assert arms["least_loaded", "turn1"]["tokenize_per_request"] == 0
    assert arms["prefix", "turn1"]["tokenize_per_request"] == 0
    (summary,) = [f for f in figures if f["figure"] == "summary"]
    assert summary["mode"] == "ppd"


@pytest.mark.bench
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--turns", "1"], "--turns must be at least 2"),
        (["--streams", "0"], "--streams and --tokenize-calls must be at least 1"),
    ],
)
def test_a_load_with_nothing_to_measure_is_refused_before_anything_starts(
    args: list[str], message: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.placement", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert message in out.stderr
    assert out.stdout == ""

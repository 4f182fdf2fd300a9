"""Rule 7: the third path (BIDIR), offered only to callers that can serve it, scored like LOCAL."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from decision_service.route import Query, Reason, Router
from decision_service.table import Figure, Table, Weights, encode_table
from tests.support.tables import row, synthetic_spec

# dTTFT_local = (64 - 16) / 64 = 0.75, dTPOT_local = (10 - 8) / 8 = 0.25: S_local(1, 1) = 0.5.
# dTTFT_bidir = (64 - 32) / 64 = 0.5,  dTPOT_bidir = (8.5 - 8) / 8 = 0.0625: S_bidir(1, 1) = 0.4375.
PD_LOCAL: dict[str, Any] = {
    "pd_ttft_ms": 64.0,
    "pd_tpot_ms": 8.0,
    "local_ttft_ms": 16.0,
    "local_tpot_ms": 10.0,
}
BIDIR: dict[str, Any] = {"bidir_ttft_ms": 32.0, "bidir_tpot_ms": 8.5, "bidir_samples": 40}
Q = Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0)  # (large, mid_bal, 4 QPS): cell (1, 5, 3)


def figures(
    *,
    pd_success: float = 1.0,
    local_success: float = 1.0,
    bidir_success: float = 1.0,
    bidir: dict[str, Any] | None = None,
) -> Any:
    """The synthetic spec with every cell measured alike (default weights (1, 1)), BIDIR everywhere."""
    spec = synthetic_spec(holes=False)
    fig = spec.figures.copy()
    fig[...] = row(
        **PD_LOCAL,
        pd_success=pd_success,
        local_success=local_success,
        pd_samples=40,
        local_samples=40,
        bidir_success=bidir_success,
        **(BIDIR if bidir is None else bidir),
    )
    return spec, fig


def uniform(**kw: Any) -> Table:
    spec, fig = figures(**kw)
    return Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig)))


def can(q: Query = Q, **changes: Any) -> Query:
    """``q`` from a caller with CAPABILITY_BIDIR."""
    return dataclasses.replace(q, bidir=True, **changes)


def test_a_table_with_bidir_figures_is_format_version_2() -> None:
    table = uniform()
    assert table.format_version == 2
    assert table.has_bidir(1, 5, 3)


def test_without_the_capability_bidir_is_never_answered() -> None:
    # BIDIR beats everything here, yet a caller that did not say it can serve it gets PD or LOCAL.
    router = Router(uniform(bidir={"bidir_ttft_ms": 1.0, "bidir_tpot_ms": 1.0, "bidir_samples": 40}))
    v = router.route(Q)
    assert (v.path, v.reason, v.score) == ("local", Reason.TABLE, 0.5)
    assert router.route(can()).path == "bidir"


@pytest.mark.parametrize(
    ("weights", "path", "score", "reason"),
    [
        (None, "local", 0.5, Reason.TABLE),  # S_local 0.5 > S_bidir 0.4375
        # (1, 2): S_local = 0.25, S_bidir = 0.375: BIDIR, scored with its own deltas.
        (Weights(1.0, 2.0), "bidir", 0.375, Reason.WEIGHTS),
        # (1, 8): S_local = -1.25, S_bidir = 0.0: nothing beats PD; S is the best of the others.
        (Weights(1.0, 8.0), "pd", 0.0, Reason.WEIGHTS),
        (Weights(1.0, 16.0), "pd", -0.5, Reason.WEIGHTS),
        # (0, 1): S_local = -0.25, S_bidir = -0.0625: PD.
        (Weights(0.0, 1.0), "pd", -0.0625, Reason.WEIGHTS),
    ],
)
def test_every_allowed_path_is_scored_against_pd_by_the_same_s(
    weights: Weights | None, path: str, score: float, reason: Reason
) -> None:
    router = Router(uniform())
    v = router.route(can(weights=weights))
    assert (v.path, v.score, v.reason) == (path, score, reason)
    assert (v.default_local, v.default_bidir) == (True, False)  # (1, 1) picks LOCAL
    b = router.cell(1, 5, 3).bidir
    assert b is not None
    assert (b.delta_ttft, b.delta_tpot) == (0.5, 0.0625)


def test_bidir_wins_under_the_default_weights_and_says_table() -> None:
    router = Router(uniform(bidir={"bidir_ttft_ms": 16.0, "bidir_tpot_ms": 8.0, "bidir_samples": 40}))
    v = router.route(can())
    assert (v.path, v.reason, v.score) == ("bidir", Reason.TABLE, 0.75)
    assert (v.default_bidir, v.default_local) == (True, False)
    assert v.alternative_allowed is False  # exploration never leaves a BIDIR answer


def test_a_tie_between_local_and_bidir_goes_local() -> None:
    router = Router(uniform(bidir={"bidir_ttft_ms": 16.0, "bidir_tpot_ms": 10.0, "bidir_samples": 40}))
    v = router.route(can())
    assert (v.path, v.score) == ("local", 0.5)


def test_bidir_missing_its_slo_is_not_considered_and_says_so() -> None:
    router = Router(
        uniform(bidir={"bidir_ttft_ms": 1.0, "bidir_tpot_ms": 1.0, "bidir_samples": 40}, bidir_success=0.5)
    )
    v = router.route(can())
    two = router.route(Q)
    assert (v.path, v.reason) == ("local", Reason.BIDIR_FAILED_IN_CELL)
    assert "bidir=0.500 vs SLO 0.95" in v.detail
    assert dataclasses.replace(v, reason=two.reason, detail=two.detail) == two
    weighted = router.route(can(weights=Weights(1.0, 4.0)))  # S_local = -0.25: PD
    assert (weighted.path, weighted.reason, weighted.score) == ("pd", Reason.BIDIR_FAILED_IN_CELL, -0.25)


def test_pd_missing_its_slo_leaves_local_and_bidir_to_the_score() -> None:
    router = Router(uniform(pd_success=0.5))
    assert router.route(Q).reason is Reason.PD_FAILED_IN_CELL
    v = router.route(can())
    assert (v.path, v.reason, v.score) == ("local", Reason.PD_FAILED_IN_CELL, 0.5)
    # Even where both score below PD, PD is out: the better of the two that met the SLO.
    v = router.route(can(weights=Weights(0.0, 1.0)))
    assert (v.path, v.reason, v.score) == ("bidir", Reason.PD_FAILED_IN_CELL, -0.0625)
    assert "success pd=0.500 local=1.000 bidir=1.000 vs SLO 0.95" in v.detail


def test_local_missing_its_slo_leaves_pd_and_bidir_to_the_score() -> None:
    router = Router(uniform(local_success=0.5))
    v = router.route(can())
    assert (v.path, v.reason, v.score) == ("bidir", Reason.LOCAL_FAILED_IN_CELL, 0.4375)
    v = router.route(can(weights=Weights(0.0, 1.0)))
    assert (v.path, v.reason, v.score) == ("pd", Reason.LOCAL_FAILED_IN_CELL, -0.0625)
    assert v.alternative_allowed is False  # the alternative of PD is LOCAL, which failed


def test_only_bidir_meeting_the_slo_gets_bidir_whatever_the_weights() -> None:
    router = Router(uniform(pd_success=0.5, local_success=0.6))
    assert router.route(Q).path == "local"  # the two-path rule: the better success rate
    v = router.route(can(weights=Weights(0.0, 100.0)))
    assert (v.path, v.reason) == ("bidir", Reason.PD_FAILED_IN_CELL)


def test_a_live_signal_forbidding_local_hands_over_to_the_better_of_pd_and_bidir() -> None:
    v = Router(uniform()).route(can(decode_kv_usage=0.99))
    assert (v.path, v.reason, v.score) == ("bidir", Reason.LIVE_SIGNAL, 0.4375)
    assert "decode KV usage 0.99" in v.detail
    assert v.alternative_allowed is False
    worse = Router(uniform(bidir={"bidir_ttft_ms": 70.0, "bidir_tpot_ms": 8.5, "bidir_samples": 40}))
    v = worse.route(can(decode_kv_usage=0.99))
    assert (v.path, v.reason) == ("pd", Reason.LIVE_SIGNAL)


def test_a_live_signal_never_touches_a_bidir_answer() -> None:
    router = Router(uniform(bidir={"bidir_ttft_ms": 16.0, "bidir_tpot_ms": 8.0, "bidir_samples": 40}))
    assert router.route(can(decode_kv_usage=0.99)) == router.route(can())


def test_bidir_figures_of_the_nearest_level_answer_a_missing_one() -> None:
    spec, fig = figures()
    fig[1, 5, 3, [Figure.PD_SAMPLES, Figure.LOCAL_SAMPLES]] = (
        0  # 4 QPS unmeasured: 2 and 6 are as near; 2 (index 2) answers
    )
    fig[1, 5, 2, Figure.BIDIR_TTFT_MS] = 8.0  # S_bidir = 0.875 - 0.0625 there
    router = Router(Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig))))
    v = router.route(can())
    assert (v.path, v.reason, v.qps_level, v.score) == ("bidir", Reason.NEAREST_CELL, 2.0, 0.8125)
    assert v.detail.startswith("no measurements at 4 QPS")


def test_a_cell_without_bidir_figures_answers_a_capable_caller_as_before() -> None:
    spec, fig = figures()
    fig[1, 5, 3, Figure.BIDIR_SAMPLES] = 0
    fig[1, 5, 3, Figure.BIDIR_TTFT_MS] = 1.0  # figures without samples are not figures
    router = Router(Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig))))
    assert router.cell(1, 5, 3).bidir is None
    for weights in (None, Weights(1.0, 2.0), Weights(0.0, 1.0)):
        assert router.route(can(weights=weights)) == router.route(dataclasses.replace(Q, weights=weights))


def test_turn_one_is_pd_for_a_capable_caller_too() -> None:
    v = Router(uniform()).route(can(turn=1))
    assert (v.path, v.reason) == ("pd", Reason.TURN_ONE)


def test_zero_sample_bidir_columns_write_a_version_1_file() -> None:
    spec = synthetic_spec()
    assert np.all(spec.figures[..., Figure.BIDIR_SAMPLES] == 0)
    assert Table.from_bytes(encode_table(spec)).format_version == 1

"""The shipped tables (tables/*.ppdt, and the real-vLLM one in tables/vllm-cpu/): present, valid, named
by key, with provenance.

They are produced by one command (docs/guides/build-tables.md, "Shipped default tables"); a full rebuild takes
minutes, so CI checks what can be checked cheaply: the server's reader accepts them, they say how they
were made, and a few of their cells equal a rebuild of those cells on the current simulator.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from decision_service.axes import paper_axes
from decision_service.table import Table
from ppd.catalog import parse_workload
from ppd.decision.v1 import decision_pb2, decision_pb2_grpc
from simulator.tools.sweep_engine import SimEngine
from table_builder.build import (
    BUILDER_VERSION,
    BuildOptions,
    axes_locator,
    build_from_records,
    default_header,
    table_file_name,
)
from table_builder.cli import main
from table_builder.sweep import GridPoint
from tests.decision_service.process import serve_process

TABLES = Path(__file__).resolve().parents[2] / "tables"
DEFAULT_SHAPES = ("1P3D", "2P2D", "3P1D")
MODEL = "llama-3.1-8b"


@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
def test_default_table_is_shipped_valid_and_documented(shape: str) -> None:
    path = TABLES / table_file_name(shape, MODEL)
    table = Table.open(path)
    try:
        assert table.key == f"{shape}/{MODEL}"
        p = table.header.provenance
        assert p["builder"] == BUILDER_VERSION
        assert p["source"] == "records"
        assert p["labels"]["engine"] == "sim"
        assert p["labels"]["profile"] == "llama-3.1-8b-h100"
        assert p["labels"]["hardware"] == "H100"
        assert len(p["inputs_sha256"]) == 64
        assert (table.header.max_decode_running, table.header.max_prefill_queue_depth) == (192, 8)
        # The full paper grid (18 workloads) and the nine huge-context ones, x 10 QPS levels x the
        # three static modes the simulated sweep runs (pd, local, bidir).
        assert len(p["runs"]) == 27 * 10 * 3
        assert p["cells"]["filled"] + p["cells"]["low_sample"] >= 100
    finally:
        table.close()


def test_check_accepts_the_whole_folder() -> None:
    assert main(["check", str(TABLES)]) == 0


# A few cells, each filled by one workload; large_tiny checks that tiny's runs fill the tiny row (its
# benchmark shape is small_bal for the live classifier, see table_builder.build.axes_locator).
SPOT_CELLS = (("small_mid_paste", 8.0), ("huge_big_paste", 20.0), ("large_tiny", 4.0))


@pytest.mark.parametrize("shape", DEFAULT_SHAPES)
def test_default_table_cells_match_a_rebuild_on_the_current_simulator(shape: str) -> None:
    """A full rebuild takes minutes, so rebuild a few cells: if this fails, the simulator or the build
    rules changed since the tables were made; rerun the command of docs/guides/build-tables.md and
    commit the tables."""
    table = Table.open(TABLES / table_file_name(shape, MODEL))
    try:
        labels = table.header.provenance["labels"]
        engine = SimEngine(
            duration_s=float(labels["duration_s"]),
            seed=int(labels["seed"]),
            profile=labels["profile"],
            link=labels["link"],
            timeout_s=float(labels["timeout_s"]),
        )
        records = [
            record
            for name, qps in SPOT_CELLS
            for mode in engine.modes
            for record in engine.run(GridPoint(shape, MODEL, mode, parse_workload(name), qps))
        ]
        rebuilt = build_from_records(records, BuildOptions(header=default_header(shape, MODEL))).spec.figures
        axes = table.header.axes
        locate = axes_locator(axes)
        for name, qps in SPOT_CELLS:
            w = parse_workload(name)
            cell = locate(
                n_ctx=w.turn2_context, n_in=w.second.n_in, n_out=w.second.n_out, qps=qps, workload=w.name
            )
            index = (cell.context, cell.workload, cell.qps)
            assert table.measured(*index)
            assert list(table.figures[index]) == list(rebuilt[index]), (
                f"{shape} {name}@{qps:g} differs from a rebuild: the table came from simulator "
                f"{labels.get('simulator')}, this is {engine.simulator}; rerun the sweep command of "
                "docs/guides/build-tables.md"
            )
    finally:
        table.close()


VLLM_CPU = TABLES / "vllm-cpu"
VLLM_KEY = "1P1D/tiny-llama-cpu"


def test_the_real_vllm_table_is_shipped_in_its_own_folder_and_says_how_it_was_measured() -> None:
    table = Table.open(VLLM_CPU / table_file_name("1P1D", "tiny-llama-cpu"))
    try:
        assert table.key == VLLM_KEY
        p = table.header.provenance
        assert p["labels"]["engine"] == "vllm-cpu"
        assert "vllm" in p["labels"]["vllm"]  # the engine's settings name vLLM's version
        levels = table.header.axes.qps_levels
        assert levels[-1] < paper_axes().qps_levels[1]  # its own QPS axis, sized for a tiny CPU model
        runs = [run.split("_") for run in p["runs"]]  # <shape>_<mode>_<workload>_<qps>
        assert {float(run[-1]) for run in runs} == set(levels)
        assert {run[1] for run in runs} == {"pd", "local"}
        assert p["cells"]["filled"] + p["cells"]["low_sample"] >= 5
    finally:
        table.close()
    assert main(["check", str(VLLM_CPU)]) == 0


def test_the_decision_service_serves_the_real_vllm_table_under_its_key_but_not_by_default() -> None:
    # What `ppd-up --engine vllm-cpu` starts: the service over tables/vllm-cpu, asked with its key.
    with serve_process(VLLM_CPU) as served, grpc.insecure_channel(served.grpc_target) as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        request = decision_pb2.RouteRequest(
            request_id="t", turn=2, new_input_tokens=16, expected_output_tokens=32, context_tokens=300,
            qps=0.4, table_key=VLLM_KEY,
        )  # fmt: skip
        answer = stub.Route(request, timeout=30)
        assert (answer.table_key, answer.reason) == (VLLM_KEY, decision_pb2.REASON_TABLE)
        assert answer.decision in (decision_pb2.DECISION_PD, decision_pb2.DECISION_LOCAL)
    # Over tables/ (the default folder) the subfolder is not read: the default key stays an H100 table.
    with serve_process(TABLES) as served, grpc.insecure_channel(served.grpc_target) as channel:
        stub = decision_pb2_grpc.DecisionServiceStub(channel)
        request = decision_pb2.RouteRequest(
            request_id="t", turn=2, new_input_tokens=16, expected_output_tokens=32, context_tokens=300, qps=1
        )
        assert stub.Route(request, timeout=30).table_key == f"1P3D/{MODEL}"


def test_the_real_vllm_table_equals_a_rebuild_from_its_shipped_records(tmp_path: Path) -> None:
    # Real runs cannot be repeated bit for bit, so their records ship beside the report
    # (docs/real-vllm/table-records) and the table must be exactly what they build.
    records = TABLES.parent / "docs" / "real-vllm" / "table-records"
    shipped = Table.open(VLLM_CPU / table_file_name("1P1D", "tiny-llama-cpu"))
    try:
        levels = ",".join(f"{q:g}" for q in shipped.header.axes.qps_levels)
        out = tmp_path / "t.ppdt"
        argv = ["build", "--records", str(records), "--shape", "1P1D", "--model", "tiny-llama-cpu"]
        assert main([*argv, "--qps-levels", levels, "--out", str(out)]) == 0
        rebuilt = Table.open(out)
        try:
            assert rebuilt.header.provenance["inputs_sha256"] == shipped.header.provenance["inputs_sha256"]
            assert rebuilt.figures.tobytes() == shipped.figures.tobytes()
        finally:
            rebuilt.close()
    finally:
        shipped.close()

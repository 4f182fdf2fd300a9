"""The paper artifact reader, on a small checked-in copy of its folder layout and on broken files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ppd.catalog import Workload
from table_builder.artifact import ArtifactError, read_artifact, scan_artifact
from tests.support.records import ARTIFACT as FIXTURE


def test_reads_every_paired_point_and_names_what_it_ignores() -> None:
    scan = read_artifact([FIXTURE])
    assert len(scan.points) == 7
    assert {p.config for p in scan.points} == {"1P_3D", "1P_3pD"}
    assert (
        "1P_1D_2pD",
        "config is not one of the PD / local pairs 1P_3D, 1P_3pD, 2P_2D, 2P_2pD, 3P_1D, 3P_1pD",
    ) in (scan.ignored)
    by_source = {p.source: p for p in scan.points}
    local = by_source["1P_3pD/1P_3pD_small_mid_paste_8.json"]
    assert local.shape == "1P3D"
    assert local.mode == "local"
    assert local.workload == Workload("small", "mid_paste")
    assert local.qps == 8.0
    assert local.ttft_ms == 40.0
    assert local.tpot_ms == 9.5
    assert local.samples == 80
    assert local.success_rate == 1.0
    half = by_source["1P_3D/1P_3D_small_mid_paste_0.5.json"]
    assert half.qps == 0.5
    assert half.mode == "pd"


def test_a_point_without_completed_requests_has_no_latency() -> None:
    scan = read_artifact([FIXTURE])
    failed = next(p for p in scan.points if p.source == "1P_3D/1P_3D_large_huge_paste_20.json")
    assert failed.ttft_ms is None
    assert failed.tpot_ms is None
    assert failed.samples == 0
    assert failed.sent == 191
    assert failed.success_rate == 0.0


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "artifact"
    shutil.copytree(FIXTURE, root)
    return root


GOOD = "1P_3D/1P_3D_small_mid_paste_8.json"


def _edit(root: Path, rel: str, **changes: object) -> None:
    path = root / rel
    obj = json.loads(path.read_text())
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            obj[outer][inner] = value
        elif value is None:
            del obj[key]
        else:
            obj[key] = value
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"turn2.avg_ttft_ms": "fast"}, "turn2.avg_ttft_ms must be a number"),
        ({"turn2.avg_tpot_ms": -1}, "turn2.avg_tpot_ms must be finite and >= 0"),
        ({"turn2.count": 1.5}, "turn2.count must be a non-negative integer"),
        ({"turn2": None}, "turn2 must be an object"),
        ({"success_rate": 250.0}, "success_rate is a percentage"),
        ({"success_rate": None}, "success_rate must be a number"),
        ({"config": "2P_2D"}, "disagrees with the folder"),
        ({"workload": "large_mid_paste"}, "disagrees with the file name"),
        ({"qps": 4}, "disagrees with the file name"),
    ],
)
def test_bad_contents_are_reported_with_the_path(
    tmp_path: Path, changes: dict[str, object], reason: str
) -> None:
    root = _copy(tmp_path)
    _edit(root, GOOD, **changes)
    scan = scan_artifact(root)
    assert [p.path for p in scan.problems] == [GOOD]
    assert reason in scan.problems[0].reason
    assert len(scan.points) == 6
    with pytest.raises(ArtifactError, match=GOOD):
        read_artifact([root])


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("1P_3D_small_mid_paste_8.json", "{not json", "invalid JSON"),
        ("1P_3D_small_mid_paste_8.json", "[]", "expected a JSON object"),
        ("1P_3D_small_mid_paste_8.json", '{"success_rate": NaN}', "NaN is not a valid number"),
        ("1P_3D_small_warp_drive_8.json", "{}", "unknown synthetic workload 'small_warp_drive'"),
        ("1P_3D_small_mid_paste_fast.json", "{}", "QPS 'fast' in the file name is not a number"),
        ("1P_3D_small_mid_paste_0.json", "{}", "must be > 0"),
        ("2P_2D_small_mid_paste_8.json", "{}", "does not start with its folder's config"),
        ("1P_3D_nothing.json", "{}", "file name is not"),
    ],
)
def test_bad_files_are_reported_with_the_path(tmp_path: Path, name: str, text: str, reason: str) -> None:
    root = tmp_path / "artifact"
    (root / "1P_3D").mkdir(parents=True)
    (root / "1P_3D" / name).write_text(text)
    scan = scan_artifact(root)
    assert [p.path for p in scan.problems] == [f"1P_3D/{name}"]
    assert reason in scan.problems[0].reason


def test_stray_files_are_listed_as_ignored(tmp_path: Path) -> None:
    root = tmp_path / "artifact"
    (root / "1P_3D").mkdir(parents=True)
    (root / "1P_3D" / "notes.txt").write_text("hi")
    (root / "summary.json").write_text("{}")
    scan = scan_artifact(root)
    assert scan.points == ()
    assert scan.problems == ()
    assert dict(scan.ignored) == {
        "1P_3D/notes.txt": "not a .json result file",
        "summary.json": "not a config folder",
    }


def test_missing_root_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(NotADirectoryError):
        scan_artifact(tmp_path / "absent")

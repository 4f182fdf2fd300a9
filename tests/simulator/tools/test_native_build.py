"""The compiled core (``ppd-sim build-native``) gives the same records as the interpreted one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from simulator.tools import native_build
from simulator.tools.cli import main as cli_main
from tests.support.ci import require_tool

# Preemption (small KV cache) and timeouts, both modes: the paths where a difference would show.
SCRIPT = """
import json, sys
from simulator.core.cluster import ClusterConfig, simulate
from simulator.tools.native_build import is_native, native_state
from simulator.core.profile import load_profile
from simulator.core.topology import Topology
from simulator.core.workload import sharegpt_like, turn_list_conversations
convs = turn_list_conversations(sharegpt_like(120, seed=3), 16, 6.0, seed=3)
out = {"native": is_native(), "state": native_state(), "runs": []}
for mode in ("pd", "local"):
    cfg = ClusterConfig(topology=Topology.parse("1P3D"), mode=mode, kv_capacity_tokens=6000, timeout_s=1.5)
    res = simulate(load_profile("llama-3.1-8b-h100"), cfg, convs)
    out["runs"].append({"records": res.records, "steps": res.engine_steps, "free": res.kv_free_blocks})
sys.stdout.write(json.dumps(out))
"""


def _simulate_in_subprocess(cwd: Path, pythonpath: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    # cwd outside the repository, so that only PYTHONPATH (or the installed project) provides simulator.
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_native_core_gives_byte_identical_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_tool("cc", "mypyc needs a C compiler")
    out = tmp_path / "native"
    assert cli_main(["build-native", "--out", str(out)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert len(line["modules"]) == len(native_build.NATIVE_MODULES)
    interpreted = _simulate_in_subprocess(tmp_path, None)
    native = _simulate_in_subprocess(tmp_path, out)
    assert (interpreted["native"], native["native"]) == (False, True)
    assert any(r["error"] == "timeout" for r in interpreted["runs"][0]["records"])
    assert native["runs"] == interpreted["runs"]
    assert (interpreted["state"], native["state"]) == ("interpreted", "native")
    # The copy knows its source: once that changes, the copy says it is stale.
    (out / "simulator" / native_build.SOURCE_NOTE).write_text(f"{tmp_path / 'changed'}\n")
    changed = tmp_path / "changed"
    shutil.copytree(out / "simulator", changed, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    engine = changed / "core" / "engine.py"
    engine.write_text(engine.read_text() + "\n# edited\n")
    assert _simulate_in_subprocess(tmp_path, out)["state"] == "native-stale"


def test_a_failed_compilation_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_build, "NATIVE_MODULES", ("no_such_module",))
    assert cli_main(["build-native", "--out", str(tmp_path / "native")]) == 1
    assert "native build failed" in caplog.text


def test_build_native_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["build-native", "--help"])
    assert exc.value.code == 0
    assert "PYTHONPATH" in capsys.readouterr().out

"""The changes serve_worker.py makes inside the real vLLM venv, checked in that venv's interpreter."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from vllm_harness.prepare import prepare, remote_script
from vllm_harness.spec import default_root

pytestmark = pytest.mark.integration

_PROBE = """
import importlib.metadata, json, os, runpy, sys
sys.argv = ["serve_worker.py"]
runpy.run_path(sys.argv_path, run_name="serve_worker")
out = {"version": importlib.metadata.version("vllm"), "prog_thread": None}
before = os.sched_getaffinity(0)
os.sched_setaffinity(0, {max(before)})
out["affinity_kept"] = os.sched_getaffinity(0) == before
if os.environ.get("PPD_VLLM_NIXL_NO_PROGRESS_THREAD") == "1":
    import nixl._api as api
    out["prog_thread"] = api.nixl_agent_config(num_threads=1).enable_pthread
print(json.dumps(out))
"""


def _probe(**env: str) -> dict[str, object]:
    python = prepare(default_root()).python
    code = _PROBE.replace("sys.argv_path", repr(str(remote_script("serve_worker.py"))))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PPD_VLLM_NIXL_")}
    out = subprocess.run(
        [str(python), "-c", code], env=clean | env, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


def test_the_version_lookup_is_answered_for_the_cpu_build_and_nothing_else_changes_by_default() -> None:
    result = _probe()
    assert result["version"] == "0.32.0+cpu"
    assert result["affinity_kept"] is False  # sched_setaffinity still works when not asked to skip it


def test_the_cpu_nixl_fixes_are_made_when_asked_for() -> None:
    result = _probe(PPD_VLLM_NIXL_NO_PROGRESS_THREAD="1", PPD_VLLM_NIXL_NO_KV_PIN="1")
    assert result["prog_thread"] is False
    assert result["affinity_kept"] is True

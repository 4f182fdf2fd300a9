from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from devstack.ready import ReadyLineError, parse_ready_line, start_ready

pytestmark = pytest.mark.integration

STANDIN = str(Path(__file__).with_name("standin.py"))


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_the_ready_line_is_one_json_object() -> None:
    assert parse_ready_line(b'{"grpc": 5}\n') == {"grpc": 5}
    assert parse_ready_line('{"url": "u"}') == {"url": "u"}
    for bad in (b"not json\n", "[1, 2]", b""):
        with pytest.raises(ValueError, match="ready line is not a JSON object"):
            parse_ready_line(bad)


def test_a_child_is_returned_with_its_ready_object() -> None:
    proc, ready = start_ready([sys.executable, STANDIN, "--ready", '{"grpc": 7}'], timeout_s=60)
    try:
        assert ready == {"grpc": 7}
        assert proc.poll() is None
    finally:
        _stop(proc)


@pytest.mark.parametrize(
    ("args", "timeout_s", "reason"),
    [
        (("--exit-before", "3"), 60.0, "svc: exited with code 3 before it was ready"),
        (("--bad-ready",), 60.0, "svc: ready line is not a JSON object: 'not json'"),
        (("--silent",), 0.5, "svc: no ready line within 0.5 s"),
    ],
)
def test_a_child_that_is_never_ready_is_stopped_and_named(
    args: tuple[str, ...], timeout_s: float, reason: str
) -> None:
    with pytest.raises(ReadyLineError) as caught:
        start_ready(
            [sys.executable, STANDIN, *args], timeout_s=timeout_s, stderr=subprocess.DEVNULL, name="svc"
        )
    assert str(caught.value) == reason


def test_a_piped_stderr_is_shown_when_the_child_fails() -> None:
    with pytest.raises(ReadyLineError, match=r"exited with code 2 before it was ready; stderr:\nbad flag"):
        start_ready(
            [sys.executable, STANDIN, "--stderr", "bad flag", "--exit-before", "2"],
            timeout_s=60,
            stderr=subprocess.PIPE,
            name="svc",
        )

"""The command line: --help everywhere, config errors exit 2 with a message, serve prints its port."""

from __future__ import annotations

import itertools
import json
import select
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.settings import Settings
from tests.gateway.processes import REPO, start


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["check-config", "--help"]])
def test_help(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 0
    assert "usage: ppd-gateway" in capsys.readouterr().out


def test_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(REPO / "gateway" / "example.toml")]) == 0
    assert "Settings(" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "sideways"\n')
    assert main(["check-config", str(bad)]) == 2
    assert "routing mode" in capsys.readouterr().err
    assert main(["serve", "--config", str(bad), "--port", "0"]) == 2
    assert main(["serve", "--mode", "nope", "--port", "0"]) == 2


def test_slo_flags_override_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "g.toml"
    config.write_text("[slo]\nttft_p99_ms = 900.0\nwindow_s = 10.0\n")
    flags = ["--slo-tpot-p99-ms", "45", "--slo-window-s", "20", "--slo-w-tpot-min", "0.5"]
    assert main(["check-config", str(config), *flags, "--slo-w-tpot-max", "8"]) == 0
    out = capsys.readouterr().out
    for field in (
        "tpot_p99_ms=45.0",
        "ttft_p99_ms=900.0",
        "window_s=20.0",
        "w_tpot_min=0.5",
        "w_tpot_max=8.0",
    ):
        assert field in out, out
    assert main(["check-config", str(config), "--slo-w-tpot-min", "20"]) == 2
    assert "w_tpot_min" in capsys.readouterr().err
    assert main(["serve", "--config", str(config), "--slo-tpot-p99-ms", "-1", "--port", "0"]) == 2
    assert "tpot_p99_ms" in capsys.readouterr().err


@pytest.mark.integration
def test_serve_prints_its_port_and_stops_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "g.toml"
    config.write_text('mode = "local"\n')
    proc = start(["gateway", "serve", "--config", str(config), "--port", "0"], tmp_path, "gateway")
    try:
        assert proc.ready["mode"] == "local"
        port = proc.ready["http"]
        assert isinstance(port, int)
        assert port > 0
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert info.value.code == 503  # no workers configured
        assert json.loads(info.value.read())["status"] == "unavailable"
    finally:
        assert proc.stop() == 0
    assert "Traceback" not in proc.stderr()


def test_python_dash_m_gateway_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in out.stdout


def test_check_config_redacts_the_secrets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "g.toml"
    config.write_text('admin_token = "adm-hunter2"\nworker_api_key = "key-hunter2"\n')
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert "admin_token='<redacted>'" in out
    assert "worker_api_key='<redacted>'" in out
    settings = Settings.from_toml(config)
    assert (settings.admin_token, settings.worker_api_key) == ("adm-hunter2", "key-hunter2")  # still usable
    assert f"Bearer {settings.worker_api_key}" == "Bearer key-hunter2"


@pytest.mark.integration
def test_a_connection_trickling_its_headers_is_closed(tmp_path: Path) -> None:
    config = tmp_path / "g.toml"
    config.write_text('mode = "local"\n[limits]\nheader_timeout_s = 0.5\n')
    proc = start(["gateway", "serve", "--config", str(config), "--port", "0"], tmp_path, "gateway")
    try:
        port = proc.ready["http"]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as prompt:
            prompt.sendall(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")  # a whole head at once: served
            assert prompt.recv(64).startswith(b"HTTP/1.1 503")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            head = itertools.cycle(b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 64)
            deadline = time.monotonic() + 60  # the header would take minutes to finish
            closed = False
            while not closed and time.monotonic() < deadline:
                try:
                    slow.sendall(bytes([next(head)]))
                    readable, _, _ = select.select([slow], [], [], 0.1)
                    closed = bool(readable) and slow.recv(64) == b""
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
            assert closed, "the server kept a connection open that never finished its headers"
    finally:
        assert proc.stop() == 0
    assert "Traceback" not in proc.stderr()


def test_the_bidir_flag_sets_the_routing_section(tmp_path: Path) -> None:
    from gateway.cli import _load

    config = tmp_path / "g.toml"
    config.write_text("[routing]\nbidir_params_ttl_s = 60.0\n")
    assert _load(str(config), None, None).routing.bidir is False
    on = _load(str(config), "bidir", None, bidir=True)
    assert (on.routing.bidir, on.routing.bidir_params_ttl_s, str(on.mode)) == (True, 60.0, "bidir")


def test_picker_reads_the_same_settings_and_refuses_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["picker", "--help"])
    assert info.value.code == 0
    assert "--grpc-port" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('mode = "sideways"\n')
    assert main(["picker", "--config", str(bad), "--grpc-port", "0"]) == 2
    assert "routing mode" in capsys.readouterr().err

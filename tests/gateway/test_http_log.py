"""Requests that are not HTTP: a 400 and one concise log line at most (rate-limited), never a traceback
per request; the served command over a raw socket, and the filter alone on a fake clock."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from gateway.http_log import MalformedRequestFilter, server_logger
from tests.gateway.processes import start

GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 10_000 + b"\r\n\r\n",  # LineTooLong
    b"GET /\x00 HTTP/1.1\r\n\r\n",  # InvalidURLError
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",  # BadHttpMessage
    b"GET / HTTP/1.1\r\nHost: x\r\n\x01\x02\r\n\r\nPOST",
]


def _send(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(payload)
        reply = b""
        while chunk := s.recv(65536):  # the server answers and closes
            reply += chunk
        return reply


@pytest.mark.integration
def test_garbage_gets_a_400_and_one_concise_line(tmp_path: Path) -> None:
    proc = start(["gateway", "serve", "--port", "0", "--mode", "local"], tmp_path, "gateway")
    try:
        for _ in range(10):
            for payload in GARBAGE:
                assert _send(proc.ready["http"], payload).startswith(b"HTTP/1.0 400 ")
    finally:
        assert proc.stop() == 0
    err = proc.stderr()
    assert "Traceback" not in err
    assert " ERROR " not in err
    lines = [line for line in err.splitlines() if "malformed HTTP request" in line]
    assert len(lines) == 1, err[-3000:]  # 40 bad requests inside a minute: one line
    assert (
        " WARNING gateway.http: malformed HTTP request from 127.0.0.1 answered 400: LineTooLong: " in lines[0]
    )
    assert len(lines[0]) < 400


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(exc: BaseException | None, msg: str = "Error handling request from %s") -> logging.LogRecord:
    info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, msg, ("10.0.0.9",), info)


def test_the_filter_rate_limits_and_counts_what_it_left_out() -> None:
    clock = _Clock()
    f = MalformedRequestFilter(interval_s=60.0, clock=clock)
    first = _record(BadHttpMessage("Invalid header\r\nInjected: yes"))
    assert f.filter(first)
    assert (first.levelno, first.exc_info) == (logging.WARNING, None)
    assert first.getMessage() == (
        "malformed HTTP request from 10.0.0.9 answered 400: BadHttpMessage: Invalid header Injected: yes"
    )  # one line: the client's CR/LF cannot split it
    assert not any(f.filter(_record(LineTooLong(b"x" * 9000, "8190"))) for _ in range(5))
    clock.now = 61.0
    later = _record(LineTooLong(b"x" * 9000, "8190"))
    assert f.filter(later)
    message = later.getMessage()
    assert message.endswith("(5 more since the last line)")
    assert len(message) < 300
    bug = _record(RuntimeError("a real bug"), "Unhandled exception")
    assert f.filter(bug)
    assert (bug.levelno, bug.exc_info is not None) == (logging.ERROR, True)  # untouched
    assert f.filter(_record(None, "no exception at all"))


def test_server_logger_reports_through_its_parent_without_touching_the_registry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parent = logging.getLogger("gateway")
    logger = server_logger(parent)
    assert logger.name == "gateway.http"
    assert logger is not logging.getLogger("gateway.http")
    caplog.set_level(logging.INFO)
    for _ in range(3):
        logger.exception("Error handling request from %s", "10.0.0.9", exc_info=BadHttpMessage("bad"))
    lines = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert [(r.name, r.levelno) for r in lines] == [("gateway.http", logging.WARNING)]
    assert not logging.getLogger("gateway.http").filters

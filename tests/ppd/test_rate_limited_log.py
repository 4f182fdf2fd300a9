"""The one rate-limited log line rule (ppd/rate_limited_log.py), as the services use it."""

from __future__ import annotations

import logging

import pytest

from ppd.rate_limited_log import RateLimitedLog


def test_one_line_per_interval_says_how_many_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("tests.rate"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tests.rate"):
        assert log.log("bad frame %d", 1)
        assert [log.log("bad frame %d", n) for n in range(2, 6)] == [False] * 4
        assert log.left_out == 4
        now[0] = 9.99
        assert not log.log("bad frame %d", 6)
        now[0] = 10.0
        assert log.log("bad frame %d", 7)
        assert log.left_out == 0
        now[0] = 20.0
        assert log.log("bad frame %d", 8)
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame 1",
        "bad frame 7 (5 more like it in the last 10 s not logged)",
        "bad frame 8",
    ]
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in caplog.records)


def test_the_level_is_the_callers(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tests.rate.level"):
        assert RateLimitedLog(logging.getLogger("tests.rate.level"), level=logging.INFO).log("hello")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, "hello")]

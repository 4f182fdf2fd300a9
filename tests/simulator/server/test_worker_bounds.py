"""Bad input never takes a worker down: a real `ppd-sim worker` process (`python -m simulator worker`, the
same entry point) given a huge chat history or prompt answers vLLM's 400 and serves on, and a SIGTERM
while a huge request is being parsed still stops it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from devstack.ready import start_ready
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 8192
# Generous: the fixed worker answers these in about a second; before the fix, tokenizing 200k chat
# messages (quadratic in special tokens) held the process for hours and even 1,500 took minutes.
REPLY_TIMEOUT_S = 90.0


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc, ready = start_ready(
        [sys.executable, "-m", "simulator", "--log-level", "WARNING", "worker", "--port", "0", *args],
        timeout_s=120.0,
        stderr=subprocess.PIPE,
    )
    return proc, str(ready["url"])


@pytest.fixture
def worker() -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc, url = _start("--spin-us", "0", "--max-model-len", str(MAX_MODEL_LEN))
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def _history(n: int) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(n)]


def _served(url: str) -> bool:
    status, body = _post(f"{url}/v1/completions", {"prompt": "hello", "max_tokens": 2})
    return status == 200 and body["usage"]["completion_tokens"] == 2


def _assert_context_length_error(status: int, body: dict[str, Any]) -> str:
    assert status == 400
    error = body["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "input_tokens", 400)
    message: str = error["message"]
    assert message.startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, ")
    return message


def test_a_huge_chat_history_is_a_400_and_the_worker_serves_on(
    worker: tuple[subprocess.Popen[str], str],
) -> None:
    _, url = worker
    status, body = _post(f"{url}/v1/chat/completions", {"messages": _history(200_000), "max_tokens": 1})
    message = _assert_context_length_error(status, body)
    assert "at least" in message  # refused on the message count alone, before tokenizing
    assert _served(url)


def test_a_long_history_within_the_message_bound_is_counted_exactly(
    worker: tuple[subprocess.Popen[str], str],
) -> None:
    _, url = worker
    history = _history(1_500)  # could fit by count (>= 7,521 tokens), does not once tokenized
    status, tokens = _post(f"{url}/tokenize", {"messages": history})
    assert status == 200
    assert tokens["count"] > MAX_MODEL_LEN
    status, body = _post(f"{url}/v1/chat/completions", {"messages": history, "max_tokens": 1})
    message = _assert_context_length_error(status, body)
    assert f"your request has {tokens['count']} input tokens" in message
    assert _served(url)


def test_a_huge_prompt_is_a_400(worker: tuple[subprocess.Popen[str], str]) -> None:
    _, url = worker
    status, body = _post(f"{url}/v1/completions", {"prompt": "hello" + " hello" * 199_999, "max_tokens": 1})
    message = _assert_context_length_error(status, body)
    assert "your request has 200001 input tokens" in message  # <|begin_of_text|> + 200,000 words
    status, body = _post(f"{url}/v1/completions", {"prompt": [9906] * 300_000, "max_tokens": 1})
    assert "your request has 300000 input tokens" in _assert_context_length_error(status, body)
    assert _served(url)


def test_sigterm_while_a_huge_request_is_parsed_stops_the_worker(
    worker: tuple[subprocess.Popen[str], str],
) -> None:
    proc, url = worker
    address = urlsplit(url)
    assert address.hostname is not None
    assert address.port is not None
    # /tokenize has no context-length check (as vLLM's): the whole history is read and tokenized.
    payload = json.dumps({"messages": _history(300_000)}).encode()
    head = f"POST /tokenize HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n\r\n"
    with socket.create_connection((address.hostname, address.port), timeout=REPLY_TIMEOUT_S) as big:
        big.sendall(head.encode() + payload)
        assert _served(url)  # the loop is not held by the request being parsed
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: proc.poll() is not None, deadline_s=60.0, what="the worker to exit after SIGTERM")
        assert proc.returncode == 0
        reply = big.recv(64)  # whatever it got: 503 (cut short), 200 (finished first) or a closed socket
        assert reply == b"" or reply.startswith((b"HTTP/1.1 503", b"HTTP/1.1 200"))
    _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err


def test_sigterm_while_a_body_trickles_in_stops_the_worker(worker: tuple[subprocess.Popen[str], str]) -> None:
    """A client that never finishes its body holds shutdown for the grace (3 s), not aiohttp's 60 s."""
    proc, url = worker
    address = urlsplit(url)
    assert address.hostname is not None
    assert address.port is not None
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
    head += "Content-Length: 1000000\r\n\r\n"
    with socket.create_connection((address.hostname, address.port), timeout=REPLY_TIMEOUT_S) as slow:
        slow.sendall(head.encode() + b'{"prompt": "')
        assert _served(url)  # by now its headers are read and its handler waits for the body
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: proc.poll() is not None, deadline_s=30.0, what="the worker to exit after SIGTERM")
        assert proc.returncode == 0

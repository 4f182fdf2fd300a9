"""Start a child and read its ready line: the one reader of our services' start-up contract.

Every service here (``ppd-decision serve``, ``ppd-gateway``, ``ppd-sim worker|cluster``, ``ppd-up``,
``ppd-vllm cluster``) prints one JSON object on one line of stdout once it accepts work, and nothing
before it. This module reads that line for the dev tooling and the tests: ``parse_ready_line`` (the
asyncio supervisor reads the bytes itself), ``read_line`` (one stdout line of a ``Popen``, with a
deadline) and ``start_ready`` (both, for ``python -m ...``-style children). The product never imports it:
the decision service's own ``--workers`` fan-out reads its children's lines in ``decision_service``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["ReadyLineError", "parse_ready_line", "read_line", "start_ready"]

_READER_JOIN_S = 5.0
_STDERR_TAIL_CHARS = 3000


class ReadyLineError(RuntimeError):
    """The child printed no ready line in time, exited first, or printed something else."""


def parse_ready_line(line: bytes | str) -> dict[str, Any]:
    """The JSON object of a ready line; ``ValueError`` naming the line when it is not one."""
    try:
        ready = json.loads(line)
    except json.JSONDecodeError:
        ready = None
    if not isinstance(ready, dict):
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        raise ValueError(f"ready line is not a JSON object: {text.strip()[:200]!r}")
    return ready


def read_line(proc: subprocess.Popen[str], *, timeout_s: float) -> str:
    """One line of ``proc``'s stdout (``""`` once it closed); after ``timeout_s`` without one the child
    is killed and ``TimeoutError`` raised.

    The read runs on a daemon thread, so a child that never writes cannot block the caller; killing
    the child closes its stdout, which ends the thread before the pipe is closed here.
    """
    stdout = proc.stdout
    if stdout is None:
        raise ValueError("the child's stdout is not a pipe")
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if line:
        return line[0]
    _stop(proc, reader)
    raise TimeoutError(f"no line on stdout within {timeout_s:g} s")


def _stop(proc: subprocess.Popen[str], reader: threading.Thread | None = None) -> int:
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    if reader is not None:
        reader.join(_READER_JOIN_S)
    # A grandchild that inherited the pipe may keep the reader blocked: leave the pipe to it then.
    if proc.stdout is not None and (reader is None or not reader.is_alive()):
        proc.stdout.close()
    return code


def start_ready(
    argv: Sequence[str],
    *,
    timeout_s: float,
    stderr: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    name: str | None = None,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start ``argv`` with its stdout piped (text) and return it with its ready line's object.

    On no line within ``timeout_s``, an exit before the line, or a line that is not a JSON object the
    child is killed and ``ReadyLineError`` says which, naming the child ``name`` (default: its command
    line) and, with ``stderr=subprocess.PIPE``, ending with the child's last stderr.
    """
    label = name if name is not None else shlex.join(argv)
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
    try:
        line = read_line(proc, timeout_s=timeout_s)
    except TimeoutError:
        raise ReadyLineError(f"{label}: no ready line within {timeout_s:g} s{_stderr_tail(proc)}") from None
    if not line:
        code = _stop(proc)
        raise ReadyLineError(f"{label}: exited with code {code} before it was ready{_stderr_tail(proc)}")
    try:
        return proc, parse_ready_line(line)
    except ValueError as exc:
        _stop(proc)
        raise ReadyLineError(f"{label}: {exc}{_stderr_tail(proc)}") from None


def _stderr_tail(proc: subprocess.Popen[str]) -> str:
    """The stopped child's last stderr, when it was piped here (else the caller holds it)."""
    stderr = proc.stderr
    if stderr is None:
        return ""
    # A grandchild that inherited the pipe may hold it open: read on a thread, for a bounded time.
    text: list[str] = []
    reader = threading.Thread(target=lambda: text.append(stderr.read()), daemon=True)
    reader.start()
    reader.join(_READER_JOIN_S)
    if not reader.is_alive():
        stderr.close()
    tail = text[0][-_STDERR_TAIL_CHARS:] if text else ""
    return f"; stderr:\n{tail}" if tail.strip() else ""

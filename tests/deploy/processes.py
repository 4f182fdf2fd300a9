"""Child processes that announce their ports as one JSON line on stdout (the repo-wide contract).

`Announced.start` spawns the command, waits (with a deadline, never a sleep) for the first stdout
line, parses it as JSON and hands it back together with the process. stderr goes to a log file,
so a chatty child never blocks on a full pipe and a failing test can show what the child said.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devstack.ready import parse_ready_line

REPO = Path(__file__).resolve().parents[2]


class ChildFailedError(RuntimeError):
    """The child exited or stayed silent instead of announcing itself."""


@dataclass
class Announced:
    """A running child and the JSON object it printed at start-up."""

    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    log: Path

    @classmethod
    def start(cls, argv: Sequence[str], *, log: Path, deadline_s: float = 30.0) -> Announced:
        return cls.start_all([(argv, log)], deadline_s=deadline_s)[0]

    @classmethod
    def start_all(
        cls, commands: Sequence[tuple[Sequence[str], Path]], *, deadline_s: float = 30.0
    ) -> list[Announced]:
        """Spawn every command first, then collect the announcements: start-ups overlap."""
        procs = [(_spawn(argv, log), argv, log) for argv, log in commands]
        started: list[Announced] = []
        try:
            for proc, argv, log in procs:
                line = _read_line(proc, deadline_s)
                try:
                    info = parse_ready_line(line)
                except ValueError as exc:
                    raise ChildFailedError(f"{argv[0]}: {exc}; log: {log.read_text()}") from None
                started.append(cls(proc=proc, info=info, log=log))
        except BaseException:
            for proc, _, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            raise
        return started

    def terminate(self, *, grace_s: float = 15.0) -> int:
        """SIGTERM, then wait for a clean exit; SIGKILL only if the grace period runs out."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def close(self) -> None:
        self.terminate()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _spawn(argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as err:
        return subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def _read_line(proc: subprocess.Popen[bytes], deadline_s: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    end = time.monotonic() + deadline_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = end - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait()
                raise ChildFailedError(f"no start-up line within {deadline_s} s")
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                code = proc.wait()
                raise ChildFailedError(f"exited with {code} before announcing itself")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()

"""A real redis-server for tests (Debian's package; `make test` installs it): its own process on a unix
socket in a fresh folder (no port to race for), no persistence, stopped by the test that started it.

`RedisServer.start()` waits until it answers PING; `kill()` takes it away mid-test (SIGKILL, as a
crash), `pause()`/`resume()` make it hang (SIGSTOP/SIGCONT) and `restart()` brings a fresh, empty one
back on the same socket.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devstack.replicas import answers_ping
from tests.support.ci import require_tool
from tests.support.polling import wait_until

__all__ = ["RedisServer"]


@dataclass
class RedisServer:
    folder: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    @classmethod
    def start(cls, *extra: str) -> RedisServer:
        require_tool("redis-server", "the shared session store's tests run a real Redis (make redis)")
        # /tmp, not pytest's tmp_path: a unix socket path must stay under 108 bytes.
        server = cls(Path(tempfile.mkdtemp(prefix="ppd-redis-", dir="/tmp")), extra)
        try:
            server._launch()
        except BaseException:
            server.close()
            raise
        return server

    def _launch(self) -> None:
        self.socket.unlink(missing_ok=True)
        with (self.folder / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    "redis-server", "--port", "0", "--unixsocket", str(self.socket),
                    "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                    "--dir", str(self.folder), *self.extra,
                ],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"redis-server exited with {proc.returncode}: {self.log_tail()}")
            return answers_ping(self.socket)

        wait_until(ready, deadline_s=30, what="redis-server to answer PING")

    def log_tail(self) -> str:
        log = self.folder / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self._launch()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)

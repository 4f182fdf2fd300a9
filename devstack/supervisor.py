"""A small process supervisor for the local stack: start children, read their ready line, stop them all.

Rule 1: a child is ready when it prints one JSON object on a line of stdout (the command-line
        contract of every service here). No line before the deadline, a line that is not a JSON
        object, or an exit before the line is a ``ChildError`` naming the child and why. A third-party
        server without that contract (``ready_line=False``) is returned as soon as it runs; the
        caller waits for its readiness its own way, and its stdout is kept with its stderr.
Rule 2: children run in their own session, so a Ctrl-C at the terminal reaches only the supervisor,
        which stops them in reverse start order: SIGTERM, then after ``grace_s`` SIGKILL to the
        child's process group (so a child's own workers go with it).
Rule 3: every child's stderr is relayed line by line, prefixed with its name, and the last lines are
        kept so a death can be explained; stdout after the ready line is drained (never blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from devstack.ready import parse_ready_line

__all__ = ["Child", "ChildError", "ChildSpec", "Supervisor"]

logger = logging.getLogger(__name__)

_TAIL_LINES = 20


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    ready_timeout_s: float = 60.0
    env: Mapping[str, str] | None = None
    # False: the child prints no JSON ready line (a third-party server); see Rule 1.
    ready_line: bool = True


class ChildError(RuntimeError):
    """A child could not start or died; ``name`` says which and ``reason`` why (with its last stderr)."""

    def __init__(self, name: str, reason: str, tail: Sequence[str] = ()) -> None:
        self.name = name
        self.reason = reason
        self.tail = tuple(tail)
        text = f"{name}: {reason}"
        if tail:
            text += "\n  last stderr lines:\n" + "\n".join(f"    {line}" for line in tail)
        super().__init__(text)


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: asyncio.subprocess.Process
    ready: dict[str, Any] = field(default_factory=dict)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    pumps: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name


class Supervisor:
    """Owns the children it started; ``stop_all`` must run before the event loop ends."""

    def __init__(self, *, relay: Callable[[str], None] | None = None, grace_s: float = 10.0) -> None:
        self._children: list[Child] = []
        self._relay = relay
        self._grace_s = grace_s

    @property
    def children(self) -> tuple[Child, ...]:
        return tuple(self._children)

    async def start(self, spec: ChildSpec) -> Child:
        """Start ``spec`` and wait for its JSON ready line (raises ChildError)."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=None if spec.env is None else dict(spec.env),
                start_new_session=True,
            )
        except OSError as exc:
            raise ChildError(spec.name, f"cannot start {spec.argv[0]!r}: {exc}") from None
        child = Child(spec=spec, proc=proc)
        self._children.append(child)
        assert proc.stderr is not None
        assert proc.stdout is not None
        child.pumps.append(asyncio.create_task(self._pump_lines(child, proc.stderr)))
        if not spec.ready_line:
            child.pumps.append(asyncio.create_task(self._pump_lines(child, proc.stdout)))
            return child
        try:
            async with asyncio.timeout(spec.ready_timeout_s):
                line = await proc.stdout.readline()
        except TimeoutError:
            raise ChildError(
                spec.name, f"no ready line within {spec.ready_timeout_s:g} s", tuple(child.tail)
            ) from None
        if not line:
            code = await proc.wait()
            await self._settle(child)
            raise ChildError(spec.name, f"exited with code {code} before it was ready", tuple(child.tail))
        try:
            ready = parse_ready_line(line)
        except ValueError as exc:
            raise ChildError(spec.name, str(exc), tuple(child.tail)) from None
        child.ready = ready
        child.pumps.append(asyncio.create_task(self._drain(proc.stdout)))
        logger.info("%s ready: %s", spec.name, json.dumps(ready))
        return child

    async def _pump_lines(self, child: Child, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").rstrip()
            child.tail.append(text)
            if self._relay is not None:
                self._relay(f"[{child.name}] {text}")

    @staticmethod
    async def _drain(stream: asyncio.StreamReader) -> None:
        while await stream.read(65536):
            pass

    async def _settle(self, child: Child) -> None:
        """Let the pumps take in what the (exited) child wrote last."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await asyncio.gather(*child.pumps, return_exceptions=True)

    async def wait_any_exit(self) -> ChildError:
        """Block until some child exits; returns the failure describing it."""
        if not self._children:
            raise RuntimeError("no children to watch")
        waits = {asyncio.create_task(c.proc.wait()): c for c in self._children}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        child = waits[next(iter(done))]
        await self._settle(child)
        code = child.proc.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return ChildError(child.name, f"{how} while the stack was running", tuple(child.tail))

    async def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every live child in reverse start order, SIGKILL stragglers; returns exit codes."""
        codes: dict[str, int | None] = {}
        for child in reversed(self._children):
            codes[child.name] = await self._stop(child)
        for child in self._children:
            for pump in child.pumps:
                pump.cancel()
            await asyncio.gather(*child.pumps, return_exceptions=True)
        self._children.clear()
        return codes

    async def _stop(self, child: Child) -> int | None:
        proc = child.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(self._grace_s):
                    await proc.wait()
            except TimeoutError:
                logger.warning(
                    "%s did not stop within %g s of SIGTERM; killing its group", child.name, self._grace_s
                )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: takes its workers along
                await proc.wait()
        logger.info("%s stopped (code %s)", child.name, proc.returncode)
        return proc.returncode

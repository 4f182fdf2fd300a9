"""TableHolder: every table of one directory, swapped in whole, never half-loaded.

Invariants:
1. `holder.current` is an immutable `TableSet`. A scan builds a new one and publishes it with one
   reference assignment; a request reads `holder.current` once and uses that snapshot throughout.
2. A file (`*.ppdt`) enters the set only after `Table.open` validated all of it and a `Router` was
   compiled for it. A file that fails validation
   is logged (file name and reason), counted (`ppd_table_reloads_total{result=<reason>}`), and the
   table previously loaded from that file, if any, keeps serving.
3. A rejected file is not retried until its stat signature (device, inode, size, mtime) changes,
   so a bad file yields one log line, not one per poll.
4. Scans never overlap: `refresh()` serialises them with a lock and runs the blocking file work on
   a worker thread, off the event loop.
5. The default key (requests without a `table_key`) never changes silently. Without a configured one,
   the first key in sorted order is pinned the first time any table loads, for the life of the
   holder. When the default table goes (its file removed or now holding another key), key-less
   requests get UNAVAILABLE and the set is not `ready` (health NOT_SERVING) until it returns; the
   loss is logged once at ERROR, the return at WARNING. They are never re-pointed to another table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from decision_service.route import Router
from decision_service.table import SUFFIX, Table, TableError

__all__ = ["ReloadListener", "ScanReport", "TableHolder", "TableSet"]

logger = logging.getLogger(__name__)


class ReloadListener(Protocol):
    """Receives the outcome of every file load (the metrics implement it)."""

    def reload(self, result: str) -> None: ...

    def tables_changed(self, tables: Iterable[tuple[str, str, Path]]) -> None: ...


@dataclass(frozen=True, slots=True)
class _Signature:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> _Signature:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class _Loaded:
    path: Path
    router: Router
    signature: _Signature

    @property
    def table(self) -> Table:
        return self.router.table


@dataclass(frozen=True, slots=True)
class TableSet:
    """One consistent view: a compiled router per table key, and the key for requests without one."""

    routers: Mapping[str, Router] = field(default_factory=dict)
    files: Mapping[str, Path] = field(default_factory=dict)
    default_key: str | None = None
    # Bound once so the hot path pays no property call: the router answering requests without a key.
    default: Router | None = None

    @property
    def ready(self) -> bool:
        """True when a request without a key can be answered."""
        return self.default is not None

    def keys(self) -> list[str]:
        return sorted(self.routers)


@dataclass(frozen=True, slots=True)
class ScanReport:
    loaded: tuple[Path, ...] = ()
    rejected: tuple[tuple[Path, str], ...] = ()
    removed: tuple[Path, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.removed)


class TableHolder:
    """Loads every table file in `directory` and keeps them current; see the module invariants."""

    current: TableSet

    def __init__(
        self,
        directory: Path,
        *,
        default_key: str | None = None,
        listener: ReloadListener | None = None,
    ) -> None:
        self.directory = directory
        # The configured default, or once pinned (invariant 5) the implicit one; never changes after.
        self._default_key = default_key
        self._default_configured = default_key is not None
        self._default_served_once = False
        self._default_missing = False
        self._listener = listener
        self._loaded: dict[Path, _Loaded] = {}
        self._rejected: dict[Path, tuple[_Signature, str]] = {}
        self._missing_dir_logged = False
        self._lock = asyncio.Lock()
        self._subscribers: list[Callable[[TableSet], Awaitable[None]]] = []
        self.current = TableSet(default_key=default_key)

    def subscribe(self, callback: Callable[[TableSet], Awaitable[None]]) -> None:
        """Call `callback(new_set)` after every `refresh()` that changed the set."""
        self._subscribers.append(callback)

    async def refresh(self) -> ScanReport:
        """Scan the directory on a worker thread, then tell subscribers if anything changed."""
        async with self._lock:
            report = await asyncio.to_thread(self.scan)
            if report.changed:
                for callback in self._subscribers:
                    await callback(self.current)
            return report

    async def watch(self, interval_s: float, stop: asyncio.Event) -> None:
        """Poll every `interval_s` seconds until `stop` is set. One failed scan never ends it."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            if stop.is_set():
                return
            try:
                await self.refresh()
            except Exception:
                logger.exception("scan of table directory %s failed; will retry", self.directory)

    def scan(self) -> ScanReport:
        """One blocking pass over the directory. Publishes a new `TableSet` when anything changed."""
        present = self._list_files()
        removed = tuple(path for path in sorted(self._loaded) if path not in present)
        for path in removed:
            entry = self._loaded.pop(path)
            logger.warning(
                "table file %s was removed; no longer serving key %s (version %s)",
                path,
                entry.table.key,
                entry.table.version,
            )
            self._report("removed")
        for path in [p for p in self._rejected if p not in present]:
            del self._rejected[path]

        loaded: list[Path] = []
        rejected: list[tuple[Path, str]] = []
        for path, signature in sorted(present.items()):
            previous = self._loaded.get(path)
            if previous is not None and previous.signature == signature:
                continue
            if path in self._rejected and self._rejected[path][0] == signature:
                continue
            outcome = self._load(path, signature)
            if isinstance(outcome, str):
                self._rejected[path] = (signature, outcome)
                rejected.append((path, outcome))
                self._report(outcome)
                continue
            self._accept(outcome, previous)
            loaded.append(path)
        if removed or loaded:
            # A key freed by this scan may let a file rejected as a duplicate in; it is retried quietly.
            for path, (signature, reason) in sorted(self._rejected.items()):
                if reason == "duplicate_key" and present.get(path) == signature:
                    retried = self._load(path, signature, quiet=True)
                    if isinstance(retried, _Loaded):
                        self._accept(retried, self._loaded.get(path))
                        loaded.append(path)

        report = ScanReport(loaded=tuple(loaded), rejected=tuple(rejected), removed=removed)
        if report.changed:
            self._publish()
        return report

    def _list_files(self) -> dict[Path, _Signature]:
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            if not self._missing_dir_logged:
                logger.warning("table directory %s does not exist; serving nothing from it", self.directory)
                self._missing_dir_logged = True
            return {}
        self._missing_dir_logged = False
        files: dict[Path, _Signature] = {}
        for entry in entries:
            # Writers publish through hidden temp files (".name.pid.tmp") and rename them into place.
            if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
                continue
            try:
                if not entry.is_file():
                    continue
                files[Path(entry.path)] = _Signature.of(entry.stat())
            except OSError:
                continue  # vanished between listing and stat: the next scan sees the truth
        return files

    def _accept(self, entry: _Loaded, previous: _Loaded | None) -> None:
        self._rejected.pop(entry.path, None)
        self._loaded[entry.path] = entry
        self._report("loaded")
        logger.info(
            "serving table %s version %s from %s%s",
            entry.table.key,
            entry.table.version,
            entry.path,
            f" (replaces version {previous.table.version})" if previous else "",
        )

    def _load(self, path: Path, signature: _Signature, *, quiet: bool = False) -> _Loaded | str:
        """The validated table, or the reason it was rejected (already logged unless `quiet`)."""
        try:
            table = Table.open(path)
            router = Router(table)
        except TableError as exc:
            logger.error(
                "rejected table file %s: %s (reason=%s); previous table keeps serving", path, exc, exc.reason
            )
            return str(exc.reason)
        except OSError as exc:
            logger.error("rejected table file %s: cannot read it: %s (reason=unreadable)", path, exc)
            return "unreadable"
        for other_path, other in self._loaded.items():
            if other_path != path and other.table.key == table.key:
                if quiet:
                    return "duplicate_key"
                logger.error(
                    "rejected table file %s: key %s is already served from %s (reason=duplicate_key)",
                    path,
                    table.key,
                    other_path,
                )
                return "duplicate_key"
        return _Loaded(path=path, router=router, signature=signature)

    def _publish(self) -> None:
        entries = sorted(self._loaded.values(), key=lambda entry: entry.path)
        routers = {entry.table.key: entry.router for entry in entries}
        files = {entry.table.key: entry.path for entry in entries}
        if self._default_key is None and routers:
            self._default_key = min(routers)
            others = ", ".join(key for key in sorted(routers) if key != self._default_key)
            logger.info(
                "requests without a table_key go to %s, pinned for the life of this process "
                "(no --default-key given%s)",
                self._default_key,
                f"; also serving {others}" if others else "",
            )
        default_key = self._default_key
        default = None if default_key is None else routers.get(default_key)
        self.current = TableSet(routers=routers, files=files, default_key=default_key, default=default)
        if self._listener is not None:
            self._listener.tables_changed((e.table.key, e.table.version, e.path) for e in entries)
        if default_key is None:
            return
        if default is None:
            if not self._default_missing:
                self._default_missing = True
                self._log_default_missing(default_key, routers)
        elif self._default_missing or not self._default_served_once:
            if self._default_served_once:
                logger.warning(
                    "default table %s is back; requests without a table_key are served again", default_key
                )
            elif self._default_configured:
                logger.info("requests without a table_key go to %s", default_key)
            self._default_missing = False
            self._default_served_once = True

    def _log_default_missing(self, default_key: str, routers: Mapping[str, Router]) -> None:
        served = ", ".join(sorted(routers)) or "nothing"
        if self._default_served_once:
            logger.error(
                "default table %s is gone (serving: %s); requests without a table_key get UNAVAILABLE "
                "and health is NOT_SERVING until it returns%s",
                default_key,
                served,
                "" if self._default_configured else "; the implicit default stays pinned, never re-pointed",
            )
        else:
            logger.warning(
                "default table key %s is not loaded (serving: %s); requests without a key get UNAVAILABLE",
                default_key,
                served,
            )

    def _report(self, result: str) -> None:
        if self._listener is not None:
            self._listener.reload(result)

"""TableHolder: loads a directory, follows new/changed/removed files, rejects bad ones safely."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from decision_service.holder import TableHolder, TableSet
from decision_service.metrics import DecisionMetrics
from decision_service.table import Table
from tests.decision_service.tables import DEFAULT_KEY, OTHER_KEY, version_of, write_table_file
from tests.support.metrics import sample
from tests.support.polling import eventually
from tests.support.tables import bad_fixtures


def reloads(metrics: DecisionMetrics, result: str) -> float:
    return sample(metrics.registry, "ppd_table_reloads_total", result=result) or 0.0


def version(tables: TableSet, key: str = DEFAULT_KEY) -> str:
    return tables.routers[key].table.version


@pytest.fixture
def metrics() -> DecisionMetrics:
    return DecisionMetrics()


def test_loads_every_valid_file_and_picks_a_default(tables_dir: Path, metrics: DecisionMetrics) -> None:
    write_table_file(tables_dir / "a.ppdt", key=OTHER_KEY)
    write_table_file(tables_dir / "b.ppdt", key=DEFAULT_KEY)
    holder = TableHolder(tables_dir, listener=metrics)
    report = holder.scan()
    assert len(report.loaded) == 2
    assert holder.current.keys() == [DEFAULT_KEY, OTHER_KEY]
    assert holder.current.default_key == DEFAULT_KEY  # first in sorted order at the first load
    assert holder.current.ready
    assert reloads(metrics, "loaded") == 2
    assert sample(metrics.registry, "ppd_tables_loaded") == 2
    labels = {"key": OTHER_KEY, "version": version_of(OTHER_KEY), "file": str(tables_dir / "a.ppdt")}
    assert sample(metrics.registry, "ppd_table_info", labels) == 1


def test_configured_default_key_wins(tables_dir: Path) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
    write_table_file(tables_dir / "b.ppdt", key=OTHER_KEY)
    holder = TableHolder(tables_dir, default_key=OTHER_KEY)
    holder.scan()
    default = holder.current.default
    assert default is not None
    assert default.table.key == OTHER_KEY


def test_empty_directory_is_not_ready(tables_dir: Path) -> None:
    holder = TableHolder(tables_dir)
    holder.scan()
    assert not holder.current.ready
    assert holder.current.routers == {}


def test_missing_directory_is_logged_once_and_served_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = TableHolder(tmp_path / "nowhere")
    with caplog.at_level(logging.WARNING, logger="decision_service.holder"):
        holder.scan()
        holder.scan()
    assert [r.getMessage() for r in caplog.records].count(
        f"table directory {tmp_path / 'nowhere'} does not exist; serving nothing from it"
    ) == 1
    assert not holder.current.ready


def test_new_file_is_picked_up(tables_dir: Path) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
    holder = TableHolder(tables_dir)
    holder.scan()
    write_table_file(tables_dir / "b.ppdt", key=OTHER_KEY)
    report = holder.scan()
    assert report.loaded == (tables_dir / "b.ppdt",)
    assert holder.current.keys() == [DEFAULT_KEY, OTHER_KEY]


def test_changed_file_is_picked_up_with_one_swap(tables_dir: Path, metrics: DecisionMetrics) -> None:
    path = tables_dir / "a.ppdt"
    v1 = write_table_file(path, seed=1)
    holder = TableHolder(tables_dir, listener=metrics)
    holder.scan()
    before = holder.current
    v2 = write_table_file(path, seed=2)
    assert v1 != v2
    holder.scan()
    after = holder.current
    assert before is not after
    assert version(before) == v1  # an in-flight request keeps its snapshot
    assert version(after) == v2
    registry = metrics.registry
    assert sample(registry, "ppd_table_info", key=DEFAULT_KEY, version=v2, file=str(path)) == 1
    assert sample(registry, "ppd_table_info", key=DEFAULT_KEY, version=v1, file=str(path)) is None


def test_unchanged_directory_keeps_the_same_snapshot(tables_dir: Path) -> None:
    write_table_file(tables_dir / "a.ppdt")
    holder = TableHolder(tables_dir)
    holder.scan()
    before = holder.current
    report = holder.scan()
    assert not report.changed
    assert holder.current is before


def test_removed_file_is_dropped(tables_dir: Path, metrics: DecisionMetrics) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
    write_table_file(tables_dir / "b.ppdt", key=OTHER_KEY)
    holder = TableHolder(tables_dir, listener=metrics)
    holder.scan()
    (tables_dir / "b.ppdt").unlink()
    report = holder.scan()
    assert report.removed == (tables_dir / "b.ppdt",)
    assert holder.current.keys() == [DEFAULT_KEY]
    assert reloads(metrics, "removed") == 1


@pytest.mark.parametrize("reason", sorted(bad_fixtures()))
def test_bad_file_is_rejected_and_the_old_table_keeps_serving(
    tables_dir: Path, metrics: DecisionMetrics, caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    path = tables_dir / "a.ppdt"
    good = write_table_file(path)
    holder = TableHolder(tables_dir, listener=metrics)
    holder.scan()
    path.write_bytes(bad_fixtures()[reason])
    with caplog.at_level(logging.ERROR, logger="decision_service.holder"):
        report = holder.scan()
        again = holder.scan()  # same bad bytes: neither logged nor counted twice
    assert report.rejected == ((path, reason),)
    assert again.rejected == ()
    assert version(holder.current) == good
    assert reloads(metrics, reason) == 1
    [record] = caplog.records
    assert str(path) in record.getMessage()
    assert f"reason={reason}" in record.getMessage()
    fixed = write_table_file(path, seed=3)  # a good file again: picked up
    holder.scan()
    assert version(holder.current) == fixed


def test_zero_byte_file_is_rejected_as_empty(tables_dir: Path, metrics: DecisionMetrics) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
    holder = TableHolder(tables_dir, listener=metrics)
    holder.scan()
    before = holder.current
    (tables_dir / "b.ppdt").write_bytes(b"")
    report = holder.scan()
    assert report.rejected == ((tables_dir / "b.ppdt", "empty"),)
    assert holder.current is before
    assert reloads(metrics, "empty") == 1


def test_duplicate_key_in_a_second_file_is_rejected(tables_dir: Path, metrics: DecisionMetrics) -> None:
    first = write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY, seed=1)
    holder = TableHolder(tables_dir, listener=metrics)
    holder.scan()
    write_table_file(tables_dir / "b.ppdt", key=DEFAULT_KEY, seed=2)
    report = holder.scan()
    assert report.rejected == ((tables_dir / "b.ppdt", "duplicate_key"),)
    assert version(holder.current) == first
    assert reloads(metrics, "duplicate_key") == 1


def test_directories_and_dangling_links_are_skipped(tables_dir: Path, metrics: DecisionMetrics) -> None:
    path = tables_dir / "a.ppdt"
    path.mkdir()  # a directory with a table's name: not a file, skipped
    (tables_dir / "b.ppdt").symlink_to(tables_dir / "missing-target")  # dangling: skipped
    holder = TableHolder(tables_dir, listener=metrics)
    report = holder.scan()
    assert report == type(report)()
    assert not holder.current.ready


def test_unreadable_file_is_rejected_as_unreadable(
    tables_dir: Path, metrics: DecisionMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tables_dir / "a.ppdt"
    write_table_file(path)

    def denied(cls: type[Table], target: object) -> Table:
        raise PermissionError(13, "Permission denied", str(target))

    # chmod cannot stop root (CI runs as root), so the reader's OSError is provoked directly.
    monkeypatch.setattr(Table, "open", classmethod(denied))
    holder = TableHolder(tables_dir, listener=metrics)
    report = holder.scan()
    assert report.rejected == ((path, "unreadable"),)
    assert reloads(metrics, "unreadable") == 1
    assert not holder.current.ready


def test_temporary_hidden_and_foreign_files_are_ignored(tables_dir: Path) -> None:
    (tables_dir / ".a.ppdt.123.tmp").write_bytes(b"half written")
    (tables_dir / ".hidden.ppdt").write_bytes(b"x")
    (tables_dir / "README.md").write_text("notes")
    (tables_dir / "sub").mkdir()
    holder = TableHolder(tables_dir)
    report = holder.scan()
    assert report == type(report)()


async def test_watch_polls_until_stopped(tables_dir: Path) -> None:
    holder = TableHolder(tables_dir)
    seen: list[list[str]] = []

    async def remember(tables: TableSet) -> None:
        seen.append(tables.keys())

    holder.subscribe(remember)
    stop = asyncio.Event()
    watcher = asyncio.create_task(holder.watch(0.01, stop))
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)

    async def picked_up() -> bool:
        return holder.current.ready

    await eventually(picked_up)
    stop.set()
    await asyncio.wait_for(watcher, timeout=10)
    assert seen == [[DEFAULT_KEY]]


async def test_watch_survives_a_failing_scan(
    tables_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    holder = TableHolder(tables_dir)
    calls = 0
    real_scan = holder.scan

    def flaky_scan() -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("disk on fire")
        return real_scan()

    monkeypatch.setattr(holder, "scan", flaky_scan)
    stop = asyncio.Event()
    watcher = asyncio.create_task(holder.watch(0.01, stop))
    write_table_file(tables_dir / "a.ppdt")

    async def picked_up() -> bool:
        return holder.current.ready

    with caplog.at_level(logging.ERROR, logger="decision_service.holder"):
        await eventually(picked_up)
    stop.set()
    await watcher
    assert "will retry" in caplog.text


def test_a_duplicate_gets_in_once_the_key_is_free(tables_dir: Path, metrics: DecisionMetrics) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY, seed=1)
    holder = TableHolder(tables_dir, listener=metrics)
    holder.scan()
    second = write_table_file(tables_dir / "b.ppdt", key=DEFAULT_KEY, seed=2)
    assert holder.scan().rejected == ((tables_dir / "b.ppdt", "duplicate_key"),)
    (tables_dir / "a.ppdt").unlink()
    report = holder.scan()
    assert report.loaded == (tables_dir / "b.ppdt",)
    assert version(holder.current) == second
    assert reloads(metrics, "duplicate_key") == 1


def test_the_implicit_default_is_pinned_at_first_load(
    tables_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_table_file(tables_dir / "b.ppdt", key=OTHER_KEY)
    holder = TableHolder(tables_dir)
    with caplog.at_level(logging.INFO, logger="decision_service.holder"):
        holder.scan()
        write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)  # sorts first, arrives later
        holder.scan()
    assert holder.current.default_key == OTHER_KEY
    default = holder.current.default
    assert default is not None
    assert default.table.key == OTHER_KEY
    assert f"requests without a table_key go to {OTHER_KEY}, pinned" in caplog.text
    assert f"go to {DEFAULT_KEY}" not in caplog.text


def test_deleting_the_implicit_default_never_re_points_key_less_requests(
    tables_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
    write_table_file(tables_dir / "b.ppdt", key=OTHER_KEY)
    holder = TableHolder(tables_dir)
    holder.scan()
    assert holder.current.default_key == DEFAULT_KEY
    with caplog.at_level(logging.INFO, logger="decision_service.holder"):
        (tables_dir / "a.ppdt").unlink()
        holder.scan()
        write_table_file(tables_dir / "c.ppdt", key="3P1D/llama-3.1-8b")  # another change while it is gone
        holder.scan()
    tables = holder.current
    assert tables.default_key == DEFAULT_KEY  # still pinned, not the next key in sorted order
    assert tables.default is None
    assert not tables.ready
    assert OTHER_KEY in tables.routers
    gone = [r for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1  # loud, and once
    assert gone[0].levelno == logging.ERROR
    assert DEFAULT_KEY in gone[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="decision_service.holder"):
        write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
        holder.scan()
    assert holder.current.ready
    assert f"default table {DEFAULT_KEY} is back" in caplog.text


def test_a_configured_default_that_goes_is_logged_once_at_error(
    tables_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_table_file(tables_dir / "a.ppdt", key=DEFAULT_KEY)
    write_table_file(tables_dir / "b.ppdt", key=OTHER_KEY)
    holder = TableHolder(tables_dir, default_key=OTHER_KEY)
    holder.scan()
    with caplog.at_level(logging.ERROR, logger="decision_service.holder"):
        (tables_dir / "b.ppdt").unlink()
        holder.scan()
    assert holder.current.default_key == OTHER_KEY
    assert not holder.current.ready
    [record] = caplog.records
    assert f"default table {OTHER_KEY} is gone" in record.getMessage()

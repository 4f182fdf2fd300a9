"""Fixtures for the decision-service tests (helpers live in harness.py, tables.py, process.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.decision_service.harness import Running, start_server
from tests.decision_service.tables import DEFAULT_KEY, write_table_file


@pytest.fixture
def tables_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tables"
    directory.mkdir()
    return directory


@pytest.fixture
def loaded_dir(tables_dir: Path) -> Path:
    write_table_file(tables_dir / "1p3d.ppdt", key=DEFAULT_KEY)
    return tables_dir


@pytest.fixture
async def running(loaded_dir: Path) -> AsyncIterator[Running]:
    served = await start_server(loaded_dir)
    yield served
    await served.channel.close()
    await served.server.stop(None)


@pytest.fixture
async def empty_server(tables_dir: Path) -> AsyncIterator[Running]:
    served = await start_server(tables_dir)
    yield served
    await served.channel.close()
    await served.server.stop(None)

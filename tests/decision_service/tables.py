"""Table files for the decision-service tests, written with the core's own writer."""

from __future__ import annotations

import functools
from pathlib import Path

from decision_service.table import Table, encode_table, write_table
from tests.support.tables import synthetic_spec

DEFAULT_KEY = "1P3D/llama-3.1-8b"
OTHER_KEY = "2P2D/llama-3.1-8b"


@functools.cache
def _encoded(shape: str, model: str, seed: int) -> tuple[bytes, str]:
    blob = encode_table(synthetic_spec(seed=seed, shape=shape, model=model))
    return blob, Table.from_bytes(blob).version


def version_of(key: str = DEFAULT_KEY, *, seed: int = 7) -> str:
    shape, model = key.split("/", 1)
    return _encoded(shape, model, seed)[1]


def write_table_file(path: Path, *, key: str = DEFAULT_KEY, seed: int = 7) -> str:
    """Publish a synthetic table atomically (as `ppd-table build` does); returns its version."""
    shape, model = key.split("/", 1)
    write_table(path, synthetic_spec(seed=seed, shape=shape, model=model))
    return version_of(key, seed=seed)


def table_bytes(*, key: str = DEFAULT_KEY, seed: int = 7) -> bytes:
    shape, model = key.split("/", 1)
    return _encoded(shape, model, seed)[0]

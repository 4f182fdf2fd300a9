"""Where ``ppd-table``'s commands read records and publish tables: the record files a list of paths
and folders names, the table path ``--out``/``--publish`` means, and the atomic publish with its summary
(a running decision service picks the file up).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from decision_service.table import Table, TableError, write_table
from table_builder.build import BuildResult, table_file_name

__all__ = ["publish", "record_paths", "resolve_out"]

logger = logging.getLogger("table_builder")


def _is_folder(raw: str) -> bool:
    return raw.endswith(("/", os.sep)) or Path(raw).is_dir()


def resolve_out(raw: str, shape: str, model: str) -> Path:
    """The table path for ``--out``/``--publish``: a file, or a folder (an existing one, or any path
    ending in '/') that gets ``<shape>__<model>.ppdt``. Missing parent folders are created."""
    path = Path(raw) / table_file_name(shape, model) if _is_folder(raw) else Path(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def publish(result: BuildResult, out: Path, *, as_json: bool) -> int:
    """Write the table atomically, print the summary; 1 when nothing could be built."""
    try:
        path = write_table(out, result.spec)
    except TableError as exc:
        logger.error("no table written: %s", exc)
        print(result.summary.format(), file=sys.stderr)
        return 1
    table = Table.open(path)
    try:
        if as_json:
            print(
                json.dumps(
                    {
                        "table": str(path),
                        "key": table.key,
                        "version": table.version,
                        **result.summary.counts(),
                    }
                )
            )
        else:
            print(result.summary.format())
            print(f"wrote {path} (key {table.key}, version {table.version})")
    finally:
        table.close()
    return 0


def record_paths(targets: Sequence[Path]) -> list[Path]:
    """Files as given; a folder stands for every ``*.jsonl`` under it (sorted), e.g. a sweep's records/."""
    paths: list[Path] = []
    for target in targets:
        if target.is_dir():
            found = sorted(target.rglob("*.jsonl"))
            if not found:
                raise FileNotFoundError(f"{target}: no *.jsonl record files in this folder")
            paths.extend(found)
        else:
            paths.append(target)
    return paths

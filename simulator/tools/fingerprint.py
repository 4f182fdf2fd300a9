"""A short digest of the simulator's own code and data, to tell which simulator produced a result.

Rule: SHA-256 (16 hex digits) over the package's ``.py`` and ``.json`` files (profiles, calibration
data), by relative path and content, in sorted order; compiled artefacts and caches do not count. So a
compiled copy made by ``ppd-sim build-native`` has the fingerprint of the source it was made from, and
tables built by a sweep name the simulator they came from (``simulator.tools.sweep_engine``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["PACKAGE_ROOT", "source_fingerprint"]

#: The folder of the ``simulator`` package this process imported (this module is ``simulator/tools/``).
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def source_fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """The digest of the simulator package at ``root`` (default: the one in use)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".json") and path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]

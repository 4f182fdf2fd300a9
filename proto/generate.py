"""Regenerate the Python stubs of the gRPC contract (``make proto``).

The stubs are checked in so that callers need no protoc; ``tests/test_proto_stubs.py``
regenerates them into a temporary folder and fails when the checked-in copy is stale.

    python proto/generate.py                 # write ppd/decision/v1/*_pb2*.py(i)
    python proto/generate.py --out DIR       # write somewhere else (the staleness test)
    python proto/generate.py --descriptor-set FILE   # also a descriptor set (Envoy transcoding)
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
PROTO_FILES = ("ppd/decision/v1/decision.proto",)
PACKAGE_DIRS = ("ppd", "ppd/decision", "ppd/decision/v1")


def generate(out: Path, descriptor_set: Path | None = None) -> None:
    """Run protoc (python, grpc and mypy-protobuf stubs) for every proto file into ``out``."""
    include = str(resources.files("grpc_tools") / "_proto")
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
    ]
    if descriptor_set is not None:
        args += ["--include_imports", "--include_source_info", f"--descriptor_set_out={descriptor_set}"]
    for package_dir in PACKAGE_DIRS:
        (out / package_dir).mkdir(parents=True, exist_ok=True)
    if protoc.main([*args, *PROTO_FILES]) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    parser.add_argument(
        "--descriptor-set", type=Path, default=None, help="also write a FileDescriptorSet here"
    )
    ns = parser.parse_args(argv)
    generate(ns.out, ns.descriptor_set)
    return 0


if __name__ == "__main__":
    sys.exit(main())

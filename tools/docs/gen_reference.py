"""Writes the reference pages in docs/reference/ from the code, so they cannot drift (dev tooling).

Rules:
1. Every page is computed from what the code declares: the commands and their flags from the argument
   parsers of every script in pyproject.toml's [project.scripts]; the gateway's settings from its
   frozen dataclasses (defaults, and the comments above each field); the decision service's settings
   with their flags and environment variables; every metric from the services' own registries; the
   gRPC API from the proto's comments (a descriptor set with source info, by grpc_tools' protoc); the
   HTTP headers from the string constants of the gateway's code.
2. What the code cannot say (what a header or an environment variable means) is written here, keyed
   by name, and checked both ways: a header or variable in the code without a description here, or a
   description of one the code no longer has, stops the generator with the names.
3. Deterministic: the same code gives the same bytes on any machine (environment variables that
   change defaults are cleared while parsers are built; no clock, no paths of this machine).
4. `python -m tools.docs.gen_reference` writes the pages; `--check` writes nothing and exits 1 naming
   the stale pages (tests/test_docs_reference.py does the same comparison).
Nothing in the product imports this file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tools.docs.refgen.commands import commands_page
from tools.docs.refgen.common import GENERATED, OUT
from tools.docs.refgen.grpc_api import grpc_page
from tools.docs.refgen.headers import headers_page
from tools.docs.refgen.metrics import metrics_page
from tools.docs.refgen.settings import settings_page

__all__ = ["index_page", "main", "pages"]


def index_page() -> str:
    return (
        "# Reference\n\n"
        + GENERATED
        + "Generated from the code by `tools/docs/gen_reference.py`; a test regenerates them and fails "
        "when a page is stale, so a new command, flag, setting, metric, header or RPC cannot go "
        "undocumented.\n\n"
        "| page | what | from |\n|---|---|---|\n"
        "| [Commands](commands.md) | every command, sub-command and flag with its default | the argument "
        "parsers of pyproject.toml's `[project.scripts]` |\n"
        "| [Settings](settings.md) | every setting with its default, flag and environment variable | "
        "`gateway/settings.py`, `decision_service/settings.py` |\n"
        "| [Metrics](metrics.md) | every metric with its type, labels and help | the services' "
        "Prometheus registries |\n"
        "| [gRPC API](grpc-api.md) | the DecisionService, its messages and enums | "
        "`proto/ppd/decision/v1/decision.proto` |\n"
        "| [HTTP headers](http-headers.md) | what the gateway reads and writes | the gateway's code |\n\n"
        "Written by hand: [Decision service](decision-service.md), [Gateway](gateway.md), "
        # "../" apart: tests/test_docs_self_contained.py reads paths relative to this file.
        "[Simulator](simulator.md), the [table format](../"
        "table-format.md) and "
        "[vLLM's P/D protocol](../"
        "vllm-protocol.md).\n"
    )


def pages() -> dict[str, Callable[[], str]]:
    return {
        "index.md": index_page,
        "commands.md": commands_page,
        "settings.md": settings_page,
        "metrics.md": metrics_page,
        "grpc-api.md": grpc_page,
        "http-headers.md": headers_page,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/reference/ from the code.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming stale pages")
    args = parser.parse_args(argv)
    stale = []
    for name, make in pages().items():
        text = make()
        path = OUT / name
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python tools/docs/gen_reference.py", file=sys.stderr)
        return 1
    for name in stale:
        print(f"wrote docs/reference/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

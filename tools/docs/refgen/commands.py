"""The commands page: every script of pyproject.toml's [project.scripts], its sub-commands and flags,
read from its own argument parser (captured at its first parse, so no CLI needs a hook for this)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import tomllib
from collections.abc import Iterator
from typing import Any, NoReturn

from tools.docs.refgen.common import GENERATED, ROOT, ReferenceError, cell, code

__all__ = ["commands_page", "parser_of", "scripts"]


class _Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


@contextlib.contextmanager
def _capture_parsers() -> Iterator[None]:
    """While active, the first parse of any ArgumentParser raises _Captured with that parser."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """Variables that change defaults (PPD_*, PYTHONHASHSEED, ...) cleared while the parsers are built."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("PPD_", "PYTHONHASHSEED"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def scripts() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command name -> "module:function"."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(config["project"]["scripts"])


def parser_of(entry: str) -> argparse.ArgumentParser:
    module, _, function = entry.partition(":")
    main = getattr(importlib.import_module(module), function)
    with _clean_environment(), _capture_parsers():
        try:
            main(["--help"])
        except _Captured as captured:
            return captured.parser
    raise ReferenceError(f"{entry} returned without parsing its arguments")


def _default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "on" if value else "off"
    if value is None or value is argparse.SUPPRESS:
        return ""
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    return str(value)


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    formatter = parser._get_formatter()
    return formatter._expand_help(action)


def _flag(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return names
        metavar = action.metavar or (action.dest.upper() if action.choices is None else None)
        if metavar is None:
            metavar = "{" + ",".join(str(c) for c in action.choices or ()) + "}"
        if isinstance(metavar, tuple):
            metavar = " ".join(metavar)
        suffix = " ..." if action.nargs in ("+", "*") else ""
        return f"{names} {metavar}{suffix}"
    name = action.metavar or action.dest
    return str(name if not isinstance(name, tuple) else " ".join(name))


def _command_section(name: str, parser: argparse.ArgumentParser, level: int, out: list[str]) -> None:
    out.append(f"{'#' * level} `{name}`\n")
    if parser.description:
        out.append(parser.description.strip() + "\n")
    rows = []
    subcommands: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for sub, subparser in action.choices.items():
                if subparser.description is None and helps.get(sub):
                    subparser.description = helps[sub]
                subcommands.append((sub, subparser))
            continue
        rows.append(
            f"| {code(_flag(action))} | {code(_default(action))} | {cell(_expanded_help(parser, action))} |"
        )
    if rows:
        out.append("| flag | default | meaning |\n|---|---|---|")
        out.extend(rows)
        out.append("")
    for sub, subparser in subcommands:
        _command_section(f"{name} {sub}", subparser, level + 1, out)


def commands_page() -> str:
    out = [
        "# Commands\n",
        GENERATED.rstrip() + "\n",
        "Every command installed by `pip install` (pyproject.toml's `[project.scripts]`), every "
        "sub-command and every flag, as its parser declares them. Each also answers `--help`.\n",
    ]
    for name, entry in sorted(scripts().items()):
        parser = parser_of(entry)
        parser.prog = name
        _command_section(name, parser, 2, out)
    return "\n".join(out).rstrip() + "\n"

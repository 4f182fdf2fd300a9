"""The settings page: the gateway's TOML keys and the decision service's settings with their defaults
(and flags and environment variables), and every PPD_* environment variable the code reads."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tools.docs.refgen.commands import parser_of, scripts
from tools.docs.refgen.common import (
    GENERATED,
    ROOT,
    ReferenceError,
    cell,
    check_described,
    code,
    python_files,
    string_constants,
)

__all__ = ["ENVIRONMENT", "annotated_config", "env_variables_in_code", "settings_page"]


def _field_comments(cls: type) -> dict[str, str]:
    """The comment lines directly above each field of a dataclass (and a comment on its own line)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in source.splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
        elif stripped.startswith("#"):
            pending.append(stripped[1:].strip())
        elif m := re.match(r"^\s{4}(\w+)\s*:[^=]*(?:=.*)?$", line):
            trailing = ""
            if "  # " in line:
                trailing = line.split("  # ", 1)[1].strip()
            comments[m.group(1)] = " ".join([*pending, trailing]).strip()
            pending = []
        else:
            pending = []
    return comments


def _toml(value: Any) -> str:  # noqa: PLR0911 - one return per TOML type
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '""' if not value else f'"{value}"'
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{}" if not value else "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if value is None:
        return "(unset)"
    return f'"{value}"'


_KEY_LINE = re.compile(r"^(?:#\s*)?(\w+)\s*=\s*[^#]*?(?:#\s*(.*))?$")
_SECTION_LINE = re.compile(r"^\[\[?([\w.]+)\]\]?\s*(?:#.*)?$")


def annotated_config() -> dict[tuple[str, str], str]:
    """(section, key) -> the comment on its line in gateway/README.md's annotated config (the fenced
    ```toml block that lists every key): the meaning of a key whose field has no comment in the code.
    The top level is section ""."""
    readme = (ROOT / "gateway" / "README.md").read_text(encoding="utf-8")
    block = readme.split("```toml\n", 1)[1].split("```", 1)[0] if "```toml\n" in readme else ""
    found: dict[tuple[str, str], str] = {}
    section, last = "", None
    for line in block.splitlines():
        stripped = line.strip()
        if m := _SECTION_LINE.match(stripped):
            section, last = m.group(1), None
        elif stripped.startswith("#") and line.startswith(" ") and last is not None:
            found[last] = f"{found[last]} {stripped.lstrip('#').strip()}".strip()
        elif m := _KEY_LINE.match(stripped):
            last = (section, m.group(1))
            found.setdefault(last, (m.group(2) or "").strip())
    return found


def _is_section(value: Any) -> bool:
    """A TOML table of its own: a nested settings value (a scalar like the mode is a dataclass too)."""
    return dataclasses.is_dataclass(value) and type(value).__name__.endswith(("Settings", "Config"))


def _settings_rows(
    cls: type, instance: Any, section: str, readme: Mapping[tuple[str, str], str], skip: Sequence[str] = ()
) -> list[str]:
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_field_comments(klass))
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if f.name in skip or _is_section(value):
            continue
        meaning = comments.get(f.name) or readme.get((section, f.name), "")
        rows.append(f"| `{f.name}` | {code(_toml(value))} | {cell(meaning)} |")
    return rows


def _gateway_settings(out: list[str]) -> None:
    from gateway.pool import WorkerSpec
    from gateway.settings import Settings, SloConfig
    from ppd.slo import SloSettings

    defaults = Settings()
    out.append("## Gateway (`ppd-gateway serve --config FILE`, `ppd-gateway picker --config FILE`)\n")
    out.append(
        "A TOML file read once at start-up; every key has a default (an empty file is a valid config) "
        "and an unknown key is an error. `ppd-gateway check-config FILE` validates one; "
        "`gateway/example.toml` is a commented example. The gateway reads no environment variable.\n"
    )
    readme = annotated_config()
    out.append("### Top level\n")
    out.append("| key | default | meaning |\n|---|---|---|")
    out.extend(_settings_rows(Settings, defaults, "", readme, skip=("workers",)))
    out.append("")
    out.append("### `[[workers]]`\n")
    out.append(
        "One table per statically configured worker (more register at run time through "
        "`POST /admin/workers`).\n"
    )
    out.append("| key | meaning |\n|---|---|")
    worker_comments = _field_comments(WorkerSpec)
    for f in dataclasses.fields(WorkerSpec):
        meaning = worker_comments.get(f.name) or readme.get(("workers", f.name), "")
        out.append(f"| `{f.name}` | {cell(meaning)} |")
    out.append("")
    for f in dataclasses.fields(Settings):
        section = getattr(defaults, f.name)
        if not _is_section(section):
            continue
        out.append(f"### `[{f.name}]`\n")
        out.append("| key | default | meaning |\n|---|---|---|")
        if isinstance(section, SloConfig):
            # [slo] holds the controller's keys and the base weights side by side (gateway/settings.py).
            out.extend(_settings_rows(SloSettings, section.controller, f.name, readme))
            out.extend(_settings_rows(SloConfig, section, f.name, readme, skip=("controller",)))
        else:
            out.extend(_settings_rows(type(section), section, f.name, readme))
        out.append("")


def _decision_settings(out: list[str]) -> None:
    from decision_service.settings import ENV_PREFIX, ENV_VARIABLES, Settings

    parser = parser_of(scripts()["ppd-decision"])
    serve = next(a.choices["serve"] for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for a in serve._actions for o in a.option_strings}
    env_of = {field: ENV_PREFIX + suffix for suffix, field, _ in ENV_VARIABLES}
    flag_of = {field: "--" + suffix.lower().replace("_", "-") for suffix, field, _ in ENV_VARIABLES}
    flag_of.setdefault("reuse_port", "--reuse-port")
    defaults = Settings()
    comments = _field_comments(Settings)
    helps = {o: a.help or "" for a in serve._actions for o in a.option_strings}
    out.append("## Decision service (`ppd-decision serve`)\n")
    out.append("Read once at start-up: an environment variable sets the default, the flag overrides it.\n")
    out.append("| setting | flag | environment variable | default | meaning |\n|---|---|---|---|---|")
    for f in dataclasses.fields(Settings):
        flag = flag_of.get(f.name, "")
        if flag not in flags:
            raise ReferenceError(f"decision service setting {f.name}: no flag {flag or '(none)'} on serve")
        value = getattr(defaults, f.name)
        out.append(
            f"| `{f.name}` | `{flag}` | {code(env_of.get(f.name, ''))} | {code(_toml(value))} "
            f"| {cell(comments.get(f.name) or helps.get(flag, '').replace('%(default)s', str(value)))} |"
        )
    out.append("")


#: What each environment variable the code reads means (rule 2). The decision service's own
#: (PPD_DECISION_*) come from decision_service.settings.ENV_VARIABLES and are not repeated here.
ENVIRONMENT: Mapping[str, str] = {
    "PPD_VLLM_HOME": "where `ppd-vllm prepare` keeps real vLLM's venv and model (default "
    "`$XDG_CACHE_HOME/ppd-router`, else `~/.cache/ppd-router`)",
    "PPD_VLLM_NIXL_NO_PROGRESS_THREAD": "`1`: a real-vLLM CPU worker turns off NIXL's UCX progress thread, "
    "which busy-polls a core (set by `ppd-vllm cluster`; vllm_harness/remote/serve_worker.py)",
    "PPD_VLLM_NIXL_NO_KV_PIN": "`1`: a real-vLLM CPU worker skips vLLM's pinning of its NIXL thread to the "
    "last core (set by `ppd-vllm cluster`)",
    "PPD_SHAPE": "Kubernetes (`deploy/k8s` overlays, the `ppd-shape` ConfigMap): the deployment's shape "
    "(`1P3D`), which names the decision service's default table key and the refresh job's table",
    "PPD_MODEL": "Kubernetes (the `ppd-shape` ConfigMap): the model label of the tables (`llama-3.1-8b`)",
    "PPD_SWEEP_URL": "Kubernetes (the `ppd-table-sweep-grid` ConfigMap of `deploy/k8s/sweep`): the front "
    "door the sweep Job drives (`http://ppd-gateway:8000`, or `http://ppd-envoy:8080`)",
    "PPD_SWEEP_WORKLOADS": "Kubernetes (`ppd-table-sweep-grid`): the sweep Job's `--workloads` (`all`)",
    "PPD_SWEEP_QPS": "Kubernetes (`ppd-table-sweep-grid`): the sweep Job's `--qps` (`all`)",
    "PPD_SWEEP_DURATION": "Kubernetes (`ppd-table-sweep-grid`): the sweep Job's seconds of arrivals per "
    "point (`10`)",
    "PPD_SWEEP_SETTLE_TIMEOUT": "Kubernetes (`ppd-table-sweep-grid`): the sweep Job's `--settle-timeout` "
    "(`300`)",
    "PPD_TEST_CLUSTER": "tests: the ready line of running P/D workers (e.g. GPU vLLM) for "
    "`pytest tests/conformance` to run against instead of starting its own",
    "PPD_UPDATE_GOLDEN": "tests: `1` rewrites the gateway's golden P/D plans instead of comparing them",
}

_ENV_NAME = re.compile(r"^PPD_[A-Z0-9_]*[A-Z0-9]$")


def env_variables_in_code() -> set[str]:
    """Every PPD_* environment variable named in our packages' and tests' code (prefixes left out)."""
    names: set[str] = set()
    for path in python_files():
        names |= {s for s in string_constants(path) if _ENV_NAME.match(s)}
    return names


def _environment(out: list[str]) -> None:
    from decision_service.settings import ENV_PREFIX, ENV_VARIABLES

    own = {ENV_PREFIX + suffix for suffix, _, _ in ENV_VARIABLES}
    found = env_variables_in_code() - own
    check_described("environment variable", found, set(ENVIRONMENT))
    out.append("## Other environment variables\n")
    out.append("| variable | meaning |\n|---|---|")
    for name in sorted(ENVIRONMENT):
        out.append(f"| `{name}` | {cell(ENVIRONMENT[name])} |")
    out.append(
        "| `PYTHONHASHSEED` | vLLM's seed of its block hashes; `ppd-up --kv-events` passes its own to the "
        "workers and to the gateway's `[kv_events] hash_seed` |"
    )
    out.append("")


def settings_page() -> str:
    out = [
        "# Settings\n",
        GENERATED.rstrip() + "\n",
        "Every setting of the two services with its default, from their settings types "
        "(`gateway/settings.py` and what it nests, `decision_service/settings.py`), and every "
        "environment variable the code reads. The other commands take flags only: "
        "[Commands](commands.md).\n",
    ]
    _gateway_settings(out)
    _decision_settings(out)
    _environment(out)
    return "\n".join(out).rstrip() + "\n"

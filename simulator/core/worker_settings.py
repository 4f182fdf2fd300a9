"""Start-up settings of one simulated worker (read once, frozen).

The KV-transfer fields mirror vLLM 0.33's `kv_connector_extra_config` of the NixlConnector
(docs/vllm-protocol.md 1.1): `kv_lease_duration`, `bidirectional_kv_xfer`, `decoder_kv_blocks_ttl` and
`kv_recompute_threshold`; `kv_load_failure_policy` mirrors its `kv_transfer_config` field (what a failed KV
load does: "fail" answers HTTP 500, "recompute" computes the prompt locally).
`server_dev_mode` mirrors vLLM's `VLLM_SERVER_DEV_MODE=1`: its development routes, of which the simulator
serves `POST /reset_prefix_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppd.kv_events import KvEventsConfig
from simulator.core.faults import Faults
from simulator.core.kv_load_policy import KV_LOAD_FAILURE_POLICIES, KvLoadFailurePolicy
from simulator.core.sampler import SamplerSettings
from simulator.core.topology import Role

__all__ = ["DEFAULT_MODEL", "WorkerSettings"]

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    worker_id: str
    role: Role
    model: str = DEFAULT_MODEL
    max_model_len: int = 131072
    host: str = "127.0.0.1"
    port: int = 0
    node: str = ""  # link endpoint name; empty = the worker id (one GPU node per worker)
    kv_lease_duration_s: float = 30.0
    bidirectional_kv_xfer: bool = False  # D returns its blocks' params; P pulls them on the next turn
    decoder_kv_blocks_ttl_s: float = 480.0  # how long D keeps a finished request's blocks (bidirectional)
    kv_recompute_threshold: int = 64  # fewer remote tokens than this are recomputed, not pulled
    kv_load_failure_policy: KvLoadFailurePolicy = "fail"  # a failed pull: HTTP 500, or a local prefill
    enable_prompt_tokens_details: bool = False
    max_body_bytes: int = 32 * 1024 * 1024
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    faults: Faults = field(default_factory=Faults)
    fault_seed: int = 0
    block_size: int | None = None  # KV block size in tokens (None: the profile's, 16)
    kv_capacity_tokens: int | None = None  # the KV cache size (None: the profile's); small = evictions
    kv_events: KvEventsConfig | None = None  # vLLM's --kv-events-config (None: no KV events)
    server_dev_mode: bool = False  # vLLM's VLLM_SERVER_DEV_MODE=1: serve POST /reset_prefix_cache

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_lease_duration_s <= 0:
            raise ValueError("kv_lease_duration_s must be > 0")
        if self.decoder_kv_blocks_ttl_s <= 0:
            raise ValueError("decoder_kv_blocks_ttl_s must be > 0")
        if self.kv_recompute_threshold < 0:
            raise ValueError("kv_recompute_threshold must be >= 0")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError("block_size must be > 0")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens <= 0:
            raise ValueError("kv_capacity_tokens must be > 0")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}")

    @property
    def node_name(self) -> str:
        return self.node or self.worker_id

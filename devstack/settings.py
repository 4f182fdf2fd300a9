"""What ``ppd-up`` starts: the stack's settings, read once from its command line (``stack.parse_settings``),
and the facts about each engine that more than one part of the stack needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ppd.tracing import TracingSettings

__all__ = ["DATA_PLANES", "DEFAULT_MODEL", "ENGINES", "KV_BLOCK_TOKENS", "StackSettings"]

#: What ``--engine`` accepts: the simulator, or real vLLM on this machine's CPU (vllm_harness).
ENGINES = ("sim", "vllm-cpu")
#: What ``--data-plane`` accepts: the gateway relays every answer (``ppd-gateway serve``), or Envoy carries
#: the traffic with ``ppd-gateway picker`` as its ext_proc endpoint picker (deploy/envoy/picker).
DATA_PLANES = ("python", "envoy")
#: The simulated cluster's model; a real cluster names its own in its ready line.
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: With --kv-events, the workers' KV block size, passed to the cluster and to the gateway's block hasher
#: alike: the simulator's H100 profile's 16, and the 32 vLLM's CPU attention needs.
KV_BLOCK_TOKENS = {"sim": 16, "vllm-cpu": 32}


@dataclass(frozen=True, slots=True)
class StackSettings:
    topology: str = "1P3D"
    engine: str = "sim"
    mode: str = "ppd"
    tables: Path = Path("tables")
    port: int = 8000
    model_label: str = "llama-3.1-8b"
    ready_timeout_s: float = 60.0
    config_dir: Path | None = None
    # More than 1: that many gateway replicas sharing sessions on Redis, behind Envoy (round robin).
    gateways: int = 1
    # Every worker publishes vLLM's KV cache events; the gateway follows them ([kv_events]).
    kv_events: bool = False
    # The workers' PYTHONHASHSEED, which seeds vLLM's block hashes ("" = unset: vLLM's fixed seed); the
    # children inherit ppd-up's environment, so main() reads it from there.
    kv_hash_seed: str = ""
    # Every worker runs vLLM's bidirectional KV mode; the gateway may serve the bidir path.
    bidir: bool = False
    # "envoy": Envoy on the stack's port streams every answer; the picker (not a gateway) routes.
    data_plane: str = "python"
    # With data_plane "envoy": "closed" (no picker, a 500 from Envoy) or "open" (no picker: the body
    # unchanged to a decode worker, which prefills it locally); devstack/data_plane.py rule 3.
    picker_failure_mode: str = "closed"
    # The gateway's SLO controller ([slo] ttft_p99_ms), milliseconds; None: off (no [slo] section).
    slo_ttft_p99_ms: float | None = None
    # --tracing-endpoint: every child exports OpenTelemetry traces there (tracing.py); the disabled
    # default: no child gets a tracing flag or section.
    tracing: TracingSettings = field(default_factory=TracingSettings)

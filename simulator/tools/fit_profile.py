"""A simulator profile fitted to micro-benchmark measurements of real workers (docs/emulator-model.md 2.5).

The measurements (``Measurements``) come from whoever can reach the workers (``ppd-vllm fit-profile``
runs them against vLLM over HTTP); this module is pure arithmetic from them to a profile dict in the
format of ``simulator/core/profiles/*.json``, and back to predictions for a check.

Rule 1: the cost model's formulas stay as they are; the fit chooses its hardware numbers so that its
        terms match the measured lines (weights efficiency 1):
        - decode step(B, c) = alpha + beta*B + gamma*B*c (least squares): gamma is KV streaming
          (kv_bytes_per_token / gamma = hbm_bytes_per_s * efficiency.kv); alpha is the per-step floor:
          the weights stream in at most half of it (at the KV rate if faster), the rest is cpu.step_s;
          beta the per-request cost (cpu.per_sampled_request_s, less one token's GEMM and elementwise work);
        - prefill(n) = a + b*n + q*n^2 (one request, nothing cached, one token out): b is the GEMMs
          (their rate 2 * layers * params_per_layer / (b - elementwise per token)), q the attention
          (its rate 4 * layers * q_heads * head_dim / 2q); flops_per_s is the faster of the two and each
          efficiency its rate over it;
        - KV pull(n) = latency + n * kv_bytes_per_token / bandwidth (least squares): the link ``measured``;
        - the proxy overheads: local_s = the round trip of a one-token request (``request_floor_s``),
          pd_s = two of them (P then D).
Rule 2: the KV capacity is the workers' KV cache (``kv_cache_bytes``), the scheduler the workers' own
        limits (given), and a coefficient the data cannot support (a slope <= 0) falls back to a bound
        that makes its term negligible, noted in the description.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from simulator.core.cost import CostModel
from simulator.core.profile import ModelSpec, Profile, load_profile, profile_from_dict

__all__ = ["MEASURED_LINK", "Measurements", "Prediction", "fit_profile", "predictions"]

#: The link preset a fitted profile defines (``ClusterConfig(link=...)``, ``ppd-sim cluster --link``).
MEASURED_LINK: Final = "measured"
_NEGLIGIBLE_S: Final = 1e-9


@dataclass(frozen=True, slots=True)
class Measurements:
    """What the micro-benchmark measured, in seconds."""

    #: (prompt tokens, seconds) of one request alone, nothing cached, one token out.
    prefill: Sequence[tuple[int, float]]
    #: (batch size, context tokens, seconds per decode step) of B requests decoding together.
    decode: Sequence[tuple[int, int, float]]
    #: (tokens, seconds) a decode worker takes to pull a prefilled prompt's KV, beyond a local request.
    transfer: Sequence[tuple[int, float]]
    #: The round trip of a one-token request with a one-token answer.
    request_floor_s: float
    notes: Mapping[str, str] = field(default_factory=dict)


def _lstsq(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares by the normal equations (tiny systems; no numpy needed)."""
    k = len(rows[0])
    ata = [[math.fsum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [math.fsum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    # Gaussian elimination with partial pivoting.
    m = [[*row[:], aty[i]] for i, row in enumerate(ata)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("the measurements cannot separate the fitted terms (too few distinct points)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] for i in range(k)]


def fit_profile(
    measured: Measurements,
    model: ModelSpec,
    *,
    name: str,
    description: str,
    hardware_name: str,
    kv_cache_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    base: str = "llama-3.1-8b-h100",
) -> dict[str, Any]:
    """The profile dict (rule 1); ``load_profile`` accepts it once written to a file."""
    if len({n for n, _ in measured.prefill}) < 3 or len({(b, c) for b, c, _ in measured.decode}) < 3:
        raise ValueError("need prefill at 3+ sizes and decode at 3+ (batch, context) pairs")
    if len({n for n, _ in measured.transfer}) < 2:
        raise ValueError("need KV pulls at 2+ sizes")
    fallbacks: list[str] = []
    alpha, beta, gamma = _lstsq(
        [(1.0, b, b * c) for b, c, _ in measured.decode], [t for _, _, t in measured.decode]
    )
    if gamma <= 0:
        fallbacks.append("decode time did not grow with context: KV reads costed as negligible")
        kv_bw = model.kv_bytes_per_token / _NEGLIGIBLE_S
    else:
        kv_bw = model.kv_bytes_per_token / gamma
    # The step floor alpha holds both the weight streaming and the engine's CPU time, which one line
    # cannot tell apart: weights stream at the KV rate, but take at most half of the floor.
    weight_bytes_step = (model.layers * model.params_per_layer + model.params_lm_head) * model.dtype_bytes
    hbm = max(kv_bw, weight_bytes_step / (0.5 * alpha)) if alpha > 0 else kv_bw
    _, b, q = _lstsq([(1.0, n, n * n) for n, _ in measured.prefill], [t for _, t in measured.prefill])
    elem_per_token = model.layers * model.activation_bytes_per_token_layer / hbm
    b_lin = b - elem_per_token
    if b_lin <= 0:
        fallbacks.append("prefill time did not grow with tokens: GEMMs costed at the elementwise rate")
        b_lin = max(b, _NEGLIGIBLE_S)
    gemm_rate = 2.0 * model.layers * model.params_per_layer / b_lin
    if q <= 0:
        fallbacks.append("no quadratic prefill term: attention at the GEMM rate")
        attn_rate = gemm_rate
    else:
        attn_rate = 4.0 * model.layers * model.q_heads * model.head_dim / (2.0 * q)
    # Efficiencies are at most 1: the faster of the two rates is the peak.
    flops = max(gemm_rate, attn_rate)
    layer_floor = 1e-6
    step_s = max(alpha - weight_bytes_step / hbm - model.layers * layer_floor, 1e-6)
    per_token_model = 2.0 * (model.layers * model.params_per_layer + model.params_lm_head) / gemm_rate
    per_sampled = max(beta - per_token_model - elem_per_token, 0.0)
    latency, slope = _lstsq([(1.0, n) for n, _ in measured.transfer], [t for _, t in measured.transfer])
    if slope <= 0:
        fallbacks.append("KV pull time did not grow with tokens: link bandwidth costed as negligible")
        bandwidth = model.kv_bytes_per_token / _NEGLIGIBLE_S
    else:
        bandwidth = model.kv_bytes_per_token / slope
    weight_bytes = model.weight_bytes
    base_profile = load_profile(base)
    notes = "; ".join([*(f"{k}: {v}" for k, v in sorted(measured.notes.items())), *fallbacks])
    raw: dict[str, Any] = {
        "name": name,
        "description": f"{description} (fitted by ppd-vllm fit-profile; {notes})" if notes else description,
        "model": {
            "name": model.name,
            "layers": model.layers,
            "hidden": model.hidden,
            "ffn": model.ffn,
            "q_heads": model.q_heads,
            "kv_heads": model.kv_heads,
            "head_dim": model.head_dim,
            "vocab": model.vocab,
            "dtype_bytes": model.dtype_bytes,
        },
        "hardware": {
            "name": hardware_name,
            "flops_per_s": flops,
            "hbm_bytes_per_s": hbm,
            # KV capacity = the workers' KV cache: memory = weights + KV cache (+ 1 byte of reserve).
            "memory_bytes": float(weight_bytes + kv_cache_bytes + 1),
            "gpu_memory_utilization": 1.0,
            "activation_reserve_bytes": 1.0,
        },
        "efficiency": {
            "gemm": gemm_rate / flops,
            "weights": 1.0,
            "attention": attn_rate / flops,
            "kv": kv_bw / hbm,
        },
        "cpu": {
            "step_s": step_s,
            "per_sampled_request_s": per_sampled,
            "frontend_per_token_s": 0.0,
            "layer_floor_s": layer_floor,
        },
        "cascade": {
            "enabled": False,
            "reread_factor": base_profile.cascade.reread_factor,
            "min_prefix_tokens": base_profile.cascade.min_prefix_tokens,
            "min_requests": base_profile.cascade.min_requests,
        },
        "scheduler": {
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
            "block_size": block_size,
        },
        "links": {MEASURED_LINK: {"bandwidth_bytes_per_s": bandwidth, "latency_s": max(latency, 0.0)}},
        "overheads": {"pd_s": 2.0 * measured.request_floor_s, "local_s": measured.request_floor_s},
        "lease_s": base_profile.lease_s,
    }
    # The cost model's roofline hides part of the per-request compute under weight streaming, so the
    # CPU terms are refitted against the model itself: measured - model = step + per_request * B.
    cost = CostModel(profile_from_dict(raw, source=name))
    rows, residuals = [], []
    for batch, context, seconds in measured.decode:
        rows.append((1.0, float(batch)))
        residuals.append(seconds - (cost.decode_only(batch, float(batch * context)) - cost.cpu(batch)))
    step, per_request = _lstsq(rows, residuals)
    raw["cpu"]["step_s"] = max(step, 1e-6)
    raw["cpu"]["per_sampled_request_s"] = max(per_request, 0.0)
    return raw


@dataclass(frozen=True, slots=True)
class Prediction:
    what: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1 if self.measured_s > 0 else math.inf


def predictions(profile: Profile, measured: Measurements) -> list[Prediction]:
    """The fitted profile's cost model on every measured point (prefill and transfer with the overheads)."""
    cost = CostModel(profile)
    link = profile.link(MEASURED_LINK)
    local = profile.overheads.local_s
    out = [
        Prediction(f"prefill {n} tokens", t, local + cost.prefill_chunks(n, 0, None))
        for n, t in measured.prefill
    ]
    out += [
        Prediction(f"decode step, batch {b}, context {c}", t, cost.decode_only(b, float(b * c)))
        for b, c, t in measured.decode
    ]
    out += [
        Prediction(
            f"KV pull {n} tokens",
            t,
            link.latency_s + n * cost.kv_bytes_per_token / link.bandwidth_bytes_per_s,
        )
        for n, t in measured.transfer
    ]
    return out

"""The step cost model of docs/emulator-model.md section 2.2 (pure arithmetic over a :class:`Profile`).

One engine step holds decode requests (context cᵢ each) and prefill chunks (nⱼ new tokens after cⱼ
cached ones). With N = Σnⱼ + #decodes and S = the sequences sampled in the step::

    T_step = T_lin(N) + T_lmhead(S) + T_elem(N) + Σⱼ T_attn_pf(nⱼ, cⱼ) + T_attn_dec(KV_read) + T_cpu

``KV_read`` (tokens of KV streamed by decode attention) is computed by the engine, which knows about
shared blocks and cascade attention; here it is just a number.

Invariants: every function is pure, returns seconds, and is monotone non-decreasing in each argument.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from simulator.core.profile import Profile

__all__ = ["CostModel"]


class CostModel:
    """Precomputes the per-profile constants once; methods are cheap enough for per-step calls."""

    __slots__ = (
        "_attn_flop_coef",
        "_attn_kv_coef",
        "_cpu_per_sampled",
        "_cpu_per_token",
        "_cpu_step",
        "_elem_floor",
        "_elem_per_token",
        "_head_c_per_token",
        "_head_w",
        "_layers",
        "_lin_c_per_token",
        "_lin_w",
        "kv_bytes_per_token",
        "kv_read_s_per_token",
    )

    def __init__(self, profile: Profile) -> None:
        model, hw, eff, cpu = profile.model, profile.hardware, profile.efficiency, profile.cpu
        wbw = hw.hbm_bytes_per_s * eff.weights
        gemm = hw.flops_per_s * eff.gemm
        self._layers = model.layers
        self._lin_w = model.params_per_layer * model.dtype_bytes / wbw
        self._lin_c_per_token = 2.0 * model.params_per_layer / gemm
        self._head_w = model.params_lm_head * model.dtype_bytes / wbw
        self._head_c_per_token = 2.0 * model.params_lm_head / gemm
        self._elem_floor = model.layers * cpu.layer_floor_s
        self._elem_per_token = model.layers * model.activation_bytes_per_token_layer / wbw
        # Prefill attention FLOPs: 4·L·heads·d_h·(n·c + n²/2).
        self._attn_flop_coef = (
            4.0 * model.layers * model.q_heads * model.head_dim / (hw.flops_per_s * eff.attention)
        )
        self.kv_bytes_per_token = model.kv_bytes_per_token
        self._attn_kv_coef = model.kv_bytes_per_token / (hw.hbm_bytes_per_s * eff.kv)
        self.kv_read_s_per_token = self._attn_kv_coef
        self._cpu_step = cpu.step_s
        self._cpu_per_sampled = cpu.per_sampled_request_s
        self._cpu_per_token = cpu.frontend_per_token_s

    def linear(self, n_tokens: int) -> float:
        """T_lin: the layer GEMMs, a p = 2 smooth roofline of weight streaming and compute."""
        if n_tokens <= 0:
            return 0.0
        return self._layers * math.hypot(self._lin_w, self._lin_c_per_token * n_tokens)

    def lm_head(self, n_sampled: int) -> float:
        if n_sampled <= 0:
            return 0.0
        return math.hypot(self._head_w, self._head_c_per_token * n_sampled)

    def elementwise(self, n_tokens: int) -> float:
        if n_tokens <= 0:
            return 0.0
        return self._elem_floor + self._elem_per_token * n_tokens

    def prefill_attention(self, n_new: int, n_cached: int) -> float:
        """max(compute of n·c + n²/2, streaming the c + n tokens of KV)."""
        if n_new <= 0:
            return 0.0
        flops = self._attn_flop_coef * (n_new * n_cached + n_new * n_new / 2.0)
        return max(flops, (n_cached + n_new) * self._attn_kv_coef)

    def decode_attention(self, kv_read_tokens: float) -> float:
        return kv_read_tokens * self._attn_kv_coef

    def cpu(self, n_sampled: int) -> float:
        """Engine CPU per step, per sampled request and per streamed token (one token per sampled request)."""
        return self._cpu_step + (self._cpu_per_sampled + self._cpu_per_token) * n_sampled

    def step(
        self,
        *,
        num_decodes: int,
        chunks: Iterable[tuple[int, int]],
        num_sampled: int,
        kv_read_tokens: float,
    ) -> float:
        """Duration of one step: ``chunks`` are (new, cached) token pairs of the prefill chunks in it."""
        n_tokens = num_decodes
        attn = 0.0
        for n_new, n_cached in chunks:
            n_tokens += n_new
            attn += self.prefill_attention(n_new, n_cached)
        if n_tokens == 0:
            return 0.0
        return (
            self.linear(n_tokens)
            + self.lm_head(num_sampled)
            + self.elementwise(n_tokens)
            + attn
            + self.decode_attention(kv_read_tokens)
            + self.cpu(num_sampled)
        )

    def decode_only(self, num_decodes: int, kv_read_tokens: float) -> float:
        """A step of ``num_decodes`` decodes and nothing else (all sampled)."""
        return self.step(
            num_decodes=num_decodes, chunks=(), num_sampled=num_decodes, kv_read_tokens=kv_read_tokens
        )

    def prefill_chunks(self, n_new: int, n_cached: int, budget: int | None) -> float:
        total = 0.0
        done = 0
        while done < n_new:
            n = n_new - done if budget is None else min(budget, n_new - done)
            last = done + n == n_new
            total += self.step(
                num_decodes=0, chunks=((n, n_cached + done),), num_sampled=1 if last else 0, kv_read_tokens=0
            )
            done += n
        return total

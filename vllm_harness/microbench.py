"""``ppd-vllm fit-profile``: a micro-benchmark against running P/D workers, fitted into a simulator profile.

The same procedure serves a GPU cluster: point ``--cluster`` at its workers' ready line (``{"workers":
[{"id", "role", "url"}, ...]}``) and name its model's profile as ``--model-from``; without ``--cluster``
it starts real vLLM on this CPU (``ppd-vllm cluster --topology 1P1D``) and fits the tiny model.

Rule 1: prompts are token ids (``/v1/completions``), random and seeded, a fresh sequence per request, so
        their lengths are exact and no prefix cache helps; every point is the median of ``repeats``.
Rule 2: what is measured (seconds, over HTTP, as a client sees it):
        - the request floor: a one-token prompt with a one-token answer on D;
        - prefill(n): one request of n tokens with a one-token answer, alone on P;
        - decode(B, c): B streamed requests of c tokens sent together to D, each ``decode_tokens`` long;
          the step is the median over requests of (last token - first token) / (tokens - 1);
        - KV pull(n): P prefills n tokens for remote decode (``do_remote_decode``), then D answers one
          token with P's ``kv_transfer_params``; the pull is D's time less the request floor.
Rule 3: the fit is ``simulator.tools.fit_profile`` (pure); this module only measures and writes, and
        prints every point next to what the fitted profile predicts.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from simulator.core.profile import ModelSpec, load_profile
from simulator.tools.fit_profile import Measurements, fit_profile, predictions

__all__ = ["BenchSettings", "cpu_name", "measure", "pick_workers", "run_fit", "tiny_model_spec"]

#: Token ids drawn for prompts: ordinary Llama-3 vocabulary, clear of the special tokens at the top.
_TOKEN_RANGE = (1_000, 120_000)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchSettings:
    prefill_sizes: tuple[int, ...] = (32, 256, 1024, 2048)
    decode_batches: tuple[int, ...] = (1, 4, 16)
    decode_contexts: tuple[int, ...] = (32, 1024)
    decode_tokens: int = 24
    transfer_sizes: tuple[int, ...] = (128, 1024, 2048)
    repeats: int = 3
    seed: int = 0
    timeout_s: float = 120.0


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), for profiles' hardware names."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "this CPU"


def tiny_model_spec() -> ModelSpec:
    """The tiny CPU model of ``vllm_harness.spec`` as the simulator's ``ModelSpec`` (bf16 weights)."""
    from vllm_harness.spec import MODEL, SERVED_MODEL

    return ModelSpec(
        name=SERVED_MODEL, layers=MODEL.num_hidden_layers, hidden=MODEL.hidden_size,
        ffn=MODEL.intermediate_size, q_heads=MODEL.num_attention_heads, kv_heads=MODEL.num_key_value_heads,
        head_dim=MODEL.head_dim,
        vocab=MODEL.vocab_size, dtype_bytes=2,
    )  # fmt: skip


class _Client:
    def __init__(self, session: aiohttp.ClientSession, model: str, rng: random.Random) -> None:
        self._session = session
        self._model = model
        self._rng = rng

    def prompt(self, n: int) -> list[int]:
        return [self._rng.randrange(*_TOKEN_RANGE) for _ in range(n)]

    async def once(
        self, url: str, prompt: list[int], max_tokens: int, **extra: Any
    ) -> tuple[float, dict[str, Any]]:
        body = {"model": self._model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, **extra}  # fmt: skip
        began = time.perf_counter()
        async with self._session.post(f"{url}/v1/completions", json=body) as response:
            payload: dict[str, Any] = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {json.dumps(payload)[:300]}")
        return time.perf_counter() - began, payload

    async def streamed_step(self, url: str, prompt: list[int], tokens: int) -> float:
        """(last token - first token) / (tokens - 1) of one streamed request."""
        body = {"model": self._model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True}  # fmt: skip
        stamps: list[float] = []
        async with self._session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {(await response.text())[:300]}")
            async for raw in response.content:
                line = raw.decode("utf-8", "replace").strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        stamps.append(time.perf_counter())
        if len(stamps) < 2:
            raise RuntimeError(f"{url} streamed {len(stamps)} tokens, asked for {tokens}")
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def _model_of(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        payload = await response.json()
    return str(payload["data"][0]["id"])


async def _measure(
    prefill_url: str, decode_url: str, settings: BenchSettings, say: Callable[[str], None]
) -> Measurements:
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = _Client(session, await _model_of(session, decode_url), random.Random(settings.seed))  # noqa: S311 - reproducible prompts

        async def median(make: Callable[[], Awaitable[float]]) -> float:
            return float(statistics.median([await make() for _ in range(settings.repeats)]))

        async def floor_once() -> float:
            return (await client.once(decode_url, client.prompt(1), 1))[0]

        await floor_once()  # warm-up: the first request of a worker pays one-off costs
        floor = await median(floor_once)
        say(f"request floor: {1e3 * floor:.1f} ms")
        prefill = []
        for n in settings.prefill_sizes:

            async def alone(n: int = n) -> float:
                return (await client.once(prefill_url, client.prompt(n), 1))[0]

            t = await median(alone)
            prefill.append((n, t))
            say(f"prefill {n} tokens: {1e3 * t:.1f} ms")
        decode = []
        for c in settings.decode_contexts:
            for b in settings.decode_batches:

                async def batch(b: int = b, c: int = c) -> float:
                    steps = await asyncio.gather(
                        *(
                            client.streamed_step(decode_url, client.prompt(c), settings.decode_tokens)
                            for _ in range(b)
                        )
                    )
                    return statistics.median(steps)

                t = await median(batch)
                decode.append((b, c, t))
                say(f"decode step, batch {b}, context {c}: {1e3 * t:.2f} ms")
        transfer = []
        for n in settings.transfer_sizes:

            async def pull(n: int = n) -> float:
                prompt = client.prompt(n)
                remote = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                          "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
                _, answer = await client.once(prefill_url, prompt, 1, kv_transfer_params=remote)
                params = answer.get("kv_transfer_params")
                if not isinstance(params, dict):
                    raise RuntimeError(
                        f"{prefill_url} returned no kv_transfer_params: is it a prefill worker?"
                    )
                t, _ = await client.once(decode_url, prompt, 1, kv_transfer_params=params)
                return max(t - floor, 0.0)

            t = await median(pull)
            transfer.append((n, t))
            say(f"KV pull {n} tokens: {1e3 * t:.1f} ms")
    return Measurements(prefill=prefill, decode=decode, transfer=transfer, request_floor_s=floor)


def measure(
    prefill_url: str, decode_url: str, settings: BenchSettings, say: Callable[[str], None] = print
) -> Measurements:
    """Rule 2's measurements against a prefill and a decode worker."""
    return asyncio.run(_measure(prefill_url, decode_url, settings, say))


def pick_workers(ready: dict[str, Any]) -> tuple[str, str]:
    """The first prefill and the first decode worker of a cluster's ready line."""
    workers = ready.get("workers")
    if not isinstance(workers, list):
        raise ValueError("the ready line lists no workers")
    by_role: dict[str, str] = {}
    for w in workers:
        if isinstance(w, dict) and isinstance(w.get("role"), str) and isinstance(w.get("url"), str):
            by_role.setdefault(w["role"], w["url"])
    if "prefill" not in by_role or "decode" not in by_role:
        raise ValueError("the cluster needs a prefill and a decode worker")
    return by_role["prefill"], by_role["decode"]


def run_fit(
    ready: dict[str, Any],
    out: Path,
    settings: BenchSettings,
    *,
    name: str,
    description: str,
    hardware_name: str,
    model: ModelSpec,
    kv_cache_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Measure, fit, write the profile to ``out``; returns the check lines (measured vs predicted)."""
    prefill_url, decode_url = pick_workers(ready)
    measured = measure(prefill_url, decode_url, settings, say)
    profile = fit_profile(
        measured, model, name=name, description=description, hardware_name=hardware_name,
        kv_cache_bytes=kv_cache_bytes, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, block_size=block_size,
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    loaded = load_profile(str(out))
    return [
        f"{p.what}: measured {1e3 * p.measured_s:.2f} ms, fitted {1e3 * p.predicted_s:.2f} ms "
        f"({100 * p.error:+.0f}%)"
        for p in predictions(loaded, measured)
    ]

"""The banner ``ppd-up`` prints once the stack is up, after its JSON line: where each part listens and
copy-paste ``curl``, ``openai`` and ``ppd-bench`` examples."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from devstack.settings import DEFAULT_MODEL, StackSettings

__all__ = ["banner"]


def banner(
    url: str,
    settings: StackSettings,
    cluster: Mapping[str, Any],
    decision: Mapping[str, Any],
    gateways: Sequence[str] = (),
    *,
    picker: Mapping[str, Any] | None = None,
) -> str:
    """What the stack prints for people once it is up (its JSON line is for scripts)."""
    front = "gateway (OpenAI API):  "
    replicas = ""
    if len(gateways) > 1:
        front = "Envoy (OpenAI API):    "
        replicas = (
            f"\n  gateway replicas:      {', '.join(gateways)} (round robin, sessions shared on redis-server)"
        )
    if picker is not None:
        front = "Envoy (OpenAI API):    "
        replicas = (
            f"\n  endpoint picker:       grpc 127.0.0.1:{picker.get('grpc')} (Envoy's ext_proc), metrics "
            f"http://127.0.0.1:{picker.get('metrics')}/metrics; Envoy streams every answer"
        )
    workers = "\n".join(f"    {w['id']:<4} {w['role']:<8} {w['url']}" for w in cluster.get("workers", []))
    model = str(cluster.get("model") or DEFAULT_MODEL)
    kind = "real vLLM workers (CPU)" if settings.engine == "vllm-cpu" else "simulated workers"
    # The tiny CPU model: its name, its 4096-token context, and answers short enough for one core.
    bench = (
        f" --model {model} --max-context-tokens 3000 --max-output-tokens 256"
        if settings.engine == "vllm-cpu"
        else ""
    )
    extras = "".join(
        text for on, text in ((settings.kv_events, ", KV events followed"), (settings.bidir, ", bidir")) if on
    )
    traces = (
        f"\n  traces (OTLP/gRPC):     every process exports to {settings.tracing.endpoint}, sampling ratio "
        f"{settings.tracing.sampling_ratio:g}"
        if settings.tracing.enabled
        else ""
    )
    return f"""
PPD stack is up ({settings.topology}, mode {settings.mode}, tables {settings.tables}{extras}).
  {front}{url}/v1{replicas}
  decision service:      grpc 127.0.0.1:{decision.get("grpc")}, metrics http://127.0.0.1:{decision.get("metrics")}/metrics
  {kind}:
{workers}{traces}

Try it:
  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' -H 'X-Session-ID: demo' \\
    -d '{{"model": "{model}", "max_tokens": 32, "stream": true,
         "messages": [{{"role": "user", "content": "Hello!"}}]}}' -D - | grep -i -e x-ppd -e data

  python -c 'import openai; c = openai.OpenAI(base_url="{url}/v1", api_key="none"); \\
print(c.chat.completions.create(model="{model}", max_tokens=32, \\
messages=[{{"role": "user", "content": "Hello!"}}]).choices[0].message.content)'

  ppd-bench run --url {url} --workload sharegpt --qps 2 --duration 10 --out records.jsonl{bench}

Response headers X-PPD-Path and X-PPD-Reason say where each turn ran and why. Ctrl-C stops everything.
"""

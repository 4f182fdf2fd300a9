"""The metrics page: every metric of our processes, from the registries they export."""

from __future__ import annotations

from typing import Any

from tools.docs.refgen.common import GENERATED, cell

__all__ = ["REGISTRY_CLASSES", "metrics_page"]


def _registries() -> list[tuple[str, str, Any]]:
    """(title, where, registry) of every metrics class of ours (tests/test_docs_reference.py checks
    that no other class builds a CollectorRegistry)."""
    from decision_service.metrics import DecisionMetrics
    from gateway.metrics import GatewayMetrics
    from simulator.server.metrics import WorkerMetrics

    return [
        (
            "Gateway and endpoint picker",
            "`ppd-gateway serve` at `/metrics` on its HTTP port; `ppd-gateway picker` on `--metrics-port`",
            GatewayMetrics().registry,
        ),
        ("Decision service", "`ppd-decision serve` on `--metrics-port`", DecisionMetrics().registry),
        (
            "Simulated workers (vLLM's names and labels)",
            "each `ppd-sim` worker at `/metrics`, as vLLM serves them; the gateway reads these",
            WorkerMetrics("MODEL").registry,
        ),
    ]


#: The classes that own a metrics registry (rule 1); a new one must be added to _registries().
REGISTRY_CLASSES = ("gateway.metrics.GatewayMetrics", "decision_service.metrics.DecisionMetrics",
                    "simulator.server.metrics.WorkerMetrics")  # fmt: skip


def metrics_page() -> str:
    out = [
        "# Metrics\n",
        GENERATED.rstrip() + "\n",
        "Every metric our processes export, from their registries, in Prometheus' text format. A "
        "counter is exported with `_total`; a histogram as `_bucket`, `_sum` and `_count`.\n",
    ]
    for title, where, registry in _registries():
        out.append(f"## {title}\n")
        out.append(f"Served by {where}.\n")
        out.append("| metric | type | labels | help |\n|---|---|---|---|")
        collectors = list(registry._collector_to_names)
        for c in sorted(collectors, key=lambda c: str(getattr(c, "_name", ""))):
            kind = str(getattr(c, "_type", ""))
            name = str(getattr(c, "_name", ""))
            shown = f"{name}_total" if kind == "counter" else name
            labels = ", ".join(f"`{label}`" for label in getattr(c, "_labelnames", ()))
            doc = cell(getattr(c, "_documentation", ""))
            out.append(f"| `{shown}` | {kind} | {labels} | {doc} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"

"""Prometheus samples in tests, read one way: through the public exposition, never a metric's internals.

A source is either a registry of our own process (``GatewayMetrics.registry``, ``DecisionMetrics.registry``:
read through ``collect()``) or the text a ``/metrics`` endpoint served (parsed by prometheus_client's
own parser). Either way a sample is named as it is exposed (a counter's ``_total``, a histogram's
``_count`` / ``_sum`` / ``_bucket``) and picked by its exact label set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Source", "sample", "samples", "total"]

Source = CollectorRegistry | str | bytes
Key = tuple[str, frozenset[tuple[str, str]]]


def _families(source: Source) -> Iterable[Metric]:
    if isinstance(source, CollectorRegistry):
        return source.collect()
    text = source.decode() if isinstance(source, bytes) else source
    return text_string_to_metric_families(text)


def samples(source: Source, name: str | None = None) -> dict[Key, float]:
    """Every sample of ``source`` (or only those called ``name``): (name, label set) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in _families(source)
        for s in family.samples
        if name is None or s.name == name
    }


def sample(
    source: Source, name: str, labels: Mapping[str, str] | None = None, /, **more: str
) -> float | None:
    """The value of the sample ``name`` with exactly these labels, or None when ``source`` has none.

    Labels as keywords (``sample(reg, "x_total", code="OK")``), or as a mapping for names that are not
    Python identifiers.
    """
    wanted = frozenset({**(labels or {}), **more}.items())
    return samples(source, name).get((name, wanted))


def total(source: Source, name: str, labels: Mapping[str, str] | None = None, /, **more: str) -> float | None:
    """The sum of the samples called ``name`` whose labels include these (a vLLM worker's series carry
    ``engine`` and ``model_name`` too), or None when ``source`` has none."""
    wanted = {**(labels or {}), **more}.items()
    found = [value for (_, have), value in samples(source, name).items() if have >= wanted]
    return sum(found) if found else None

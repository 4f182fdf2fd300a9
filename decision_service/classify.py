"""Map a live request onto the cells of a table: pure functions over ``Axes``.

The hot path (``route``) uses ``CompiledClassifier``, which resolves class names to indices once per
table so a lookup is a few comparisons and ``bisect`` calls.
"""

from __future__ import annotations

from bisect import bisect_left

from decision_service.axes import Axes

__all__ = ["CompiledClassifier", "context_class", "qps_index", "workload_class"]


class CompiledClassifier:
    """Axes turned into index tables; immutable after construction."""

    __slots__ = (
        "_balanced",
        "_balanced_edges",
        "_balanced_up_to",
        "_context_edges",
        "_decode",
        "_decode_below",
        "_decode_edges",
        "_nq",
        "_nw",
        "_prefill",
        "_prefill_edges",
        "_qps",
        "_qps_mid",
    )

    def __init__(self, axes: Axes) -> None:
        index = {name: i for i, name in enumerate(axes.workload_names())}
        c = axes.classifier
        self._context_edges = axes.context_edges
        self._decode_below = c.decode_heavy_below
        self._balanced_up_to = c.balanced_up_to
        self._decode_edges = c.decode_out_edges
        self._decode = tuple(index[n] for n in c.decode_classes)
        self._balanced_edges = c.balanced_in_edges
        self._balanced = tuple(index[n] for n in c.balanced_classes)
        self._prefill_edges = c.prefill_in_edges
        self._prefill = tuple(index[n] for n in c.prefill_classes)
        self._qps = axes.qps_levels
        _, self._nw, self._nq = axes.shape
        # Midpoints between neighbouring levels: a live QPS snaps to the nearest level, ties go down.
        self._qps_mid = tuple((a + b) / 2 for a, b in zip(axes.qps_levels, axes.qps_levels[1:], strict=False))

    def context(self, n_ctx: int) -> int:
        return bisect_left(self._context_edges, n_ctx)

    def workload(self, n_in: int, n_out: int) -> int:
        r = n_in / (n_out if n_out > 1 else 1)
        if r < self._decode_below:
            return self._decode[bisect_left(self._decode_edges, n_out)]
        if r <= self._balanced_up_to:
            return self._balanced[bisect_left(self._balanced_edges, n_in)]
        return self._prefill[bisect_left(self._prefill_edges, n_in)]

    def qps(self, qps: float) -> int:
        return bisect_left(self._qps_mid, qps)

    def cell_index(self, n_in: int, n_out: int, n_ctx: int, qps: float) -> int:
        """Flat index of the (context, workload, qps) cell in C order; the hot path, kept inline."""
        r = n_in / (n_out if n_out > 1 else 1)
        if r < self._decode_below:
            w = self._decode[bisect_left(self._decode_edges, n_out)]
        elif r <= self._balanced_up_to:
            w = self._balanced[bisect_left(self._balanced_edges, n_in)]
        else:
            w = self._prefill[bisect_left(self._prefill_edges, n_in)]
        return (bisect_left(self._context_edges, n_ctx) * self._nw + w) * self._nq + bisect_left(
            self._qps_mid, qps
        )


def context_class(axes: Axes, n_ctx: int) -> int:
    """Index of the context class of ``n_ctx`` accumulated tokens (edges are inclusive upper bounds)."""
    return bisect_left(axes.context_edges, n_ctx)


def workload_class(axes: Axes, n_in: int, n_out: int) -> int:
    """Index into ``axes.workloads`` of a turn with ``n_in`` new and ``n_out`` expected tokens."""
    return CompiledClassifier(axes).workload(n_in, n_out)


def qps_index(axes: Axes, qps: float) -> int:
    """Index of the QPS level nearest to ``qps`` (a tie goes to the lower level)."""
    return CompiledClassifier(axes).qps(qps)

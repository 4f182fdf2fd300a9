"""The ``ppd`` mode's per-request rule in the cluster simulation: the decision service's pure core.

The same code decides in simulation and in production: :class:`TableRouter` wraps
``decision_service.route.Router`` (one compiled table) behind the cluster's :class:`LocalPolicy`
protocol, with the live signals a gateway would attach (the session's decode worker's running batch,
the chosen prefill worker's queue), so the table's decode-load guard acts here as it does live.
A query the rule refuses (``QueryError``) takes PD, as the gateway's fallback would, and is counted.
``verdict`` gives the whole verdict (for exploration, ``ClusterConfig.explore``: whether the other
path is allowed, and whether a live signal acted), ``local`` only its path.
``use_table`` swaps the table mid-run (the closed loop's refresh, loadgen/report/drift.py).
"""

from __future__ import annotations

import dataclasses

from decision_service.route import Query, QueryError, Router, Verdict, check_query
from decision_service.table import Table, Weights

__all__ = ["TableRouter"]


class TableRouter:
    """Turns 2+ go LOCAL when the table's verdict says so (with optional per-run weights; a query's own
    weights, such as the SLO controller's, come first)."""

    __slots__ = ("_router", "_table", "_weights", "refused", "verdicts")

    def __init__(self, table: Table, weights: Weights | None = None) -> None:
        self._table = table
        self._router = Router(table)
        self._weights = weights
        self.refused = 0
        self.verdicts: dict[str, int] = {}

    @classmethod
    def open(cls, path: str, weights: Weights | None = None) -> TableRouter:
        return cls(Table.open(path), weights)

    @property
    def base_weights(self) -> Weights:
        """The weights it scores with unless a query brings its own (the cluster's SLO controller)."""
        return self._weights if self._weights is not None else self._table.header.default_weights

    def use_table(self, table: Table) -> None:
        """Route with ``table`` from the next request on (a refreshed table, swapped in mid-run in
        virtual time, as the decision service hot-reloads a file); the counters go on."""
        self._table = table
        self._router = Router(table)

    def local(self, conversation_id: str, query: Query) -> bool:
        verdict = self.verdict(conversation_id, query)
        return verdict is not None and verdict.local

    def verdict(self, conversation_id: str, query: Query) -> Verdict | None:
        """The rule's verdict; None when it refuses the query (then the turn takes PD)."""
        del conversation_id
        if self._weights is not None and query.weights is None:
            query = dataclasses.replace(query, weights=self._weights)
        try:
            check_query(query, self._table)
        except QueryError:
            self.refused += 1
            return None
        verdict = self._router.route(query)
        name = verdict.reason.name
        self.verdicts[name] = self.verdicts.get(name, 0) + 1
        return verdict

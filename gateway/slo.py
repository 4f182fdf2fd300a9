"""The gateway's side of the SLO controller (ppd/slo.py): one controller per table key, fed by finished
turns, asked for the weights of every Route request, and shown in /metrics and /health.

Rule 1: one `SloController` per table key, made on first use; the key "" (the DecisionService's
default table) is shown as "default".
Rule 2: every time comes from the injected clock (the app's monotonic `clock`), so a controller's
windows and ticks never read the wall clock and tests drive them with a manual clock.
Rule 3: the metrics read the controllers' state when scraped (gauge functions), so the request path
pays for an append and, once per `slo.interval_s`, one P99.
Rule 4: a controller observes only what its weights route (`routed`): turns 2+ that took a path the
decision chooses between (pd, local, bidir). Turn 1 always goes P/D and a replica turn never asks,
whatever the weights, so their latencies (one client's 30k-token first prompt) must not move them.
"""

from __future__ import annotations

import math
from typing import Any

from gateway.metrics import GatewayMetrics
from gateway.settings import SloConfig
from gateway.types import Clock
from ppd.slo import SloController, SloState

__all__ = ["SloControl", "routed", "table_label"]

_DIRECTION = {"up": 1.0, "down": -1.0, "hold": 0.0}
#: Rule 4: the paths a Route decision chooses between.
_ROUTED_PATHS = frozenset({"pd", "local", "bidir"})


def routed(turn: int, path: str) -> bool:
    """Rule 4: whether the weights had a say in this turn's path."""
    return turn >= 2 and path in _ROUTED_PATHS


def table_label(table_key: str) -> str:
    return table_key or "default"


class SloControl:
    """Rules 1-3, over the app's metrics and clock."""

    __slots__ = ("_clock", "_config", "_controllers", "_metrics")

    def __init__(self, config: SloConfig, metrics: GatewayMetrics, clock: Clock) -> None:
        config.controller.validate()
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._controllers: dict[str, SloController] = {}

    @classmethod
    def from_config(cls, config: SloConfig, metrics: GatewayMetrics, clock: Clock) -> SloControl | None:
        """None when no target is set (the gateway then sends no weights, as before)."""
        return cls(config, metrics, clock) if config.controller.enabled else None

    def weights(self, table_key: str) -> tuple[float, float]:
        """(w_ttft, w_tpot) for a Route request on this table."""
        return self._controller(table_key).weights(self._clock())

    def observe(
        self, table_key: str, *, ttft_s: float | None, tpot_s: float | None, started: float | None = None
    ) -> None:
        """A finished turn's TTFT and TPOT (None: not measured)."""
        self._controller(table_key).observe(self._clock(), ttft_s=ttft_s, tpot_s=tpot_s, started=started)

    def states(self) -> dict[str, SloState]:
        now = self._clock()
        return {table_label(key): c.state(now) for key, c in sorted(self._controllers.items())}

    def health(self) -> dict[str, Any]:
        """The /health section: the targets and each table's state."""
        s = self._config.controller
        return {
            "tpot_p99_ms": s.tpot_p99_ms,
            "ttft_p99_ms": s.ttft_p99_ms,
            "tables": {key: state.to_json() for key, state in self.states().items()},
        }

    def _controller(self, table_key: str) -> SloController:
        ctrl = self._controllers.get(table_key)
        if ctrl is None:
            c = self._config
            ctrl = SloController(c.controller, c.base_w_ttft, c.base_w_tpot)
            self._controllers[table_key] = ctrl
            self._bind(table_label(table_key), ctrl)
        return ctrl

    def _bind(self, label: str, ctrl: SloController) -> None:
        m, clock = self._metrics, self._clock

        def state() -> SloState:
            return ctrl.state(clock())

        def seconds(ms: float | None) -> float:
            return math.nan if ms is None else ms / 1e3

        m.slo_w_tpot.labels(label).set_function(lambda: state().w_tpot)
        m.slo_w_ttft.labels(label).set_function(lambda: state().w_ttft)
        m.slo_direction.labels(label).set_function(lambda: _DIRECTION[state().direction])
        m.slo_tpot_p99.labels(label).set_function(lambda: seconds(state().tpot_p99_ms))
        m.slo_ttft_p99.labels(label).set_function(lambda: seconds(state().ttft_p99_ms))

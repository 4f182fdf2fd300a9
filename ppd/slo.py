"""The SLO controller on the routing weights: from the observed windowed P99s of TTFT and TPOT it moves
the w_tpot a caller sends with each Route request, so a TPOT target holds while as much of the TTFT
gain of LOCAL turns is kept as that target allows. Pure: every method takes `now` (seconds, from the
caller's monotonic clock); nothing here reads a clock, sleeps or keeps module state. One controller per
table key (the gateway) or per simulated cluster.

The lever. The decision service scores S = w_ttft * delta_ttft - w_tpot * delta_tpot and goes LOCAL
when S > 0; a LOCAL turn wins TTFT and costs the decode worker's TPOT. Raising w_tpot sends fewer
turns LOCAL (TPOT falls, TTFT rises); lowering it sends more. w_ttft stays at the base: only the
ratio matters to the verdict, and one moving weight keeps the state readable.

Rule 1 (the control law), at most once per `interval_s`, over the samples of the last `window_s`:
  - a configured target with fewer than `min_samples` samples in the window: no change;
  - TPOT p99 above tpot_target: w_tpot up one step (TPOT is held first);
  - else, with TPOT room (no TPOT target, or TPOT p99 below tpot_target * (1 - 2 * hysteresis)):
    TTFT p99 above ttft_target: w_tpot down one step, as far as w_tpot_min;
    otherwise w_tpot back one step towards the base (never past it): with no pressure the
    controller is the fixed-weights router;
  - anything else (a p99 inside its band): no change. So the weights never chatter while the
    p99s stay within their bands. A target is a ceiling: each band, 2 x hysteresis wide, lies just
    below its target, so the controller holds the P99 at or under the target, not around it.
A step is multiplicative: up is w * (1 + step), down is w / (1 + step), clamped to
[w_tpot_min, w_tpot_max] (and to the base when relaxing).
Rule 2 (no wind-up): the state is the clamped weight itself, not an accumulated error; a long
saturation at a bound leaves nothing to unwind, so the first tick that sees the opposite pressure moves
away from the bound. Windowed samples age out after `window_s` whatever happened before.
Rule 3 (bounded memory): the window holds at most `max_samples` samples per signal (the oldest go
first), so a burst cannot grow it without bound.
Rule 4 (judge the weight in force): every move empties both windows, and a finished request that
started before the last move (`observe(started=...)`, the caller's clock) is not a sample: it was
routed under the old weight. So the next tick judges only requests routed under the new weight, once
`min_samples` of them are in (a 30 s window judged every 5 s would otherwise see the old weight's P99
for six more ticks, and long answers finishing after a move would show it for longer still, and it
would keep moving: overshoot).
Rule 5 (back off relaxing, hold near the flip point): a relax that the next move undoes (TPOT over
right after relaxing) found the flip point; the weight it relaxed from is the lowest known to hold.
Relaxing to that weight is free, but below it the controller waits `relax_wait` seconds from its last
step up, and each such cycle doubles that wait (from `window_s` up to 16 x `window_s`). Once the wait
is over it relaxes tick by tick as before, so a lasting drop in load still brings it to the base;
reaching the base forgets the flip point and the wait. While it waits the reason is relax_wait.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Direction", "SloController", "SloSettings", "SloState", "p99"]

Direction = Literal["up", "down", "hold"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SloSettings:
    """Targets and the controller's tuning. No target: the controller never moves (the gateway and
    the simulator build none)."""

    #: P99 of the time per output token to hold, milliseconds; None: no TPOT target.
    tpot_p99_ms: float | None = None
    #: P99 of the time to first token to aim for when TPOT has room, milliseconds; None: none.
    ttft_p99_ms: float | None = None
    #: The P99s are over the samples of the last window_s seconds.
    window_s: float = 30.0
    #: Bounds of w_tpot (w_ttft stays at the base).
    w_tpot_min: float = 0.25
    w_tpot_max: float = 16.0
    #: Relative change of w_tpot per adjustment (0.25: x1.25 up, /1.25 down).
    step: float = 0.25
    #: Half-width of the dead band just below each target, relative (0.05: from -10 % to the target).
    hysteresis: float = 0.05
    #: Fewer samples than this in the window for a configured target: no change.
    min_samples: int = 50
    #: At most one adjustment per interval_s seconds, so each step's effect reaches the window.
    interval_s: float = 5.0
    #: Most samples kept per signal (the window's memory bound).
    max_samples: int = 4096

    @property
    def enabled(self) -> bool:
        return self.tpot_p99_ms is not None or self.ttft_p99_ms is not None

    def validate(self) -> None:
        """Raises ValueError naming the first bad setting."""
        for name in ("tpot_p99_ms", "ttft_p99_ms"):
            target = getattr(self, name)
            if target is not None and not (math.isfinite(target) and target > 0):
                raise ValueError(f"slo.{name} must be a positive number of milliseconds, got {target}")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"slo.window_s must be positive, got {self.window_s}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"slo.interval_s must be positive, got {self.interval_s}")
        if not (0 < self.w_tpot_min <= self.w_tpot_max and math.isfinite(self.w_tpot_max)):
            raise ValueError(
                f"need 0 < slo.w_tpot_min <= slo.w_tpot_max, got {self.w_tpot_min}, {self.w_tpot_max}"
            )
        if not (math.isfinite(self.step) and self.step > 0):
            raise ValueError(f"slo.step must be positive, got {self.step}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"slo.hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.min_samples < 1 or self.max_samples < self.min_samples:
            raise ValueError(
                f"need 1 <= slo.min_samples <= slo.max_samples, got {self.min_samples}, {self.max_samples}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class SloState:
    """What the controller sends and why, for metrics, /health and reports."""

    w_ttft: float
    w_tpot: float
    #: The windowed P99s now, milliseconds; None below min_samples.
    tpot_p99_ms: float | None
    ttft_p99_ms: float | None
    tpot_samples: int
    ttft_samples: int
    #: The last tick's move and its cause: tpot_over, ttft_over, relax (back towards the base),
    #: at_base (no pressure, at the base), in_band (a p99 inside its dead band), too_few_samples,
    #: at_bound (pressure, but w_tpot already at its bound), relax_wait (room, but a recent relax
    #: was undone: rule 5), or "" before the first tick.
    direction: Direction
    reason: str
    adjustments: int

    def to_json(self) -> dict[str, Any]:
        return {
            "w_ttft": self.w_ttft,
            "w_tpot": self.w_tpot,
            "tpot_p99_ms": self.tpot_p99_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "tpot_samples": self.tpot_samples,
            "ttft_samples": self.ttft_samples,
            "direction": self.direction,
            "reason": self.reason,
            "adjustments": self.adjustments,
        }


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile of a non-empty list (the smallest value >= 99 % of them)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class _Window:
    """Samples (time, value) of the last window_s seconds, at most `cap` of them."""

    __slots__ = ("_cap", "_samples", "_span")

    def __init__(self, span: float, cap: int) -> None:
        self._span = span
        self._cap = cap
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        if len(self._samples) > self._cap:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def evict(self, now: float) -> None:
        samples, oldest = self._samples, now - self._span
        while samples and samples[0][0] <= oldest:
            samples.popleft()

    def __len__(self) -> int:
        return len(self._samples)

    def p99(self) -> float:
        return p99([v for _, v in self._samples])


class SloController:
    """Rule 1-3 of the module docstring, for one table key."""

    __slots__ = (
        "_adjustments",
        "_base_tpot",
        "_direction",
        "_good",
        "_last",
        "_last_move",
        "_last_up",
        "_moved_at",
        "_next_tick",
        "_reason",
        "_relax_wait",
        "_relaxed_from",
        "_s",
        "_tpot",
        "_ttft",
        "_w_tpot",
        "_w_ttft",
    )

    def __init__(self, settings: SloSettings, base_w_ttft: float, base_w_tpot: float) -> None:
        settings.validate()
        if not (math.isfinite(base_w_ttft) and base_w_ttft >= 0):
            raise ValueError(f"base w_ttft must be finite and >= 0, got {base_w_ttft}")
        if not (math.isfinite(base_w_tpot) and base_w_tpot > 0):
            raise ValueError(f"base w_tpot must be finite and positive, got {base_w_tpot}")
        self._s = settings
        self._w_ttft = base_w_ttft
        # A base outside the bounds starts at the nearest bound (and relaxes only that far).
        self._base_tpot = min(max(base_w_tpot, settings.w_tpot_min), settings.w_tpot_max)
        self._w_tpot = self._base_tpot
        self._tpot = _Window(settings.window_s, settings.max_samples)
        self._ttft = _Window(settings.window_s, settings.max_samples)
        self._next_tick = -math.inf
        self._last = -math.inf
        self._direction: Direction = "hold"
        self._reason = ""
        self._adjustments = 0
        # Rule 5: the reason of the last move, when w_tpot last went up, the weight the last relax
        # left, the lowest weight known to hold, and how long to hold above it after a step up.
        self._last_move = ""
        self._last_up = -math.inf
        self._moved_at = -math.inf
        self._relaxed_from = self._base_tpot
        self._good = self._base_tpot
        self._relax_wait = 0.0

    def observe(
        self, now: float, *, ttft_s: float | None, tpot_s: float | None, started: float | None = None
    ) -> None:
        """One finished request's figures (None: not measured, e.g. TPOT of a one-token answer);
        ``started``: when it was routed (rule 4), None when unknown (taken as routed now)."""
        now = self._monotonic(now)
        if started is not None and started < self._moved_at:
            return
        if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0:
            self._ttft.add(now, ttft_s * 1e3)
        if tpot_s is not None and math.isfinite(tpot_s) and tpot_s >= 0:
            self._tpot.add(now, tpot_s * 1e3)

    def weights(self, now: float) -> tuple[float, float]:
        """(w_ttft, w_tpot) to send now; adjusts first when a tick is due (rule 1)."""
        now = self._monotonic(now)
        if now >= self._next_tick:
            self._next_tick = now + self._s.interval_s
            self._tick(now)
        return self._w_ttft, self._w_tpot

    def state(self, now: float) -> SloState:
        """The state as of `now` (p99s over the window ending now); changes no weight."""
        now = self._monotonic(now)
        self._tpot.evict(now)
        self._ttft.evict(now)
        return SloState(
            w_ttft=self._w_ttft,
            w_tpot=self._w_tpot,
            tpot_p99_ms=self._p99(self._tpot),
            ttft_p99_ms=self._p99(self._ttft),
            tpot_samples=len(self._tpot),
            ttft_samples=len(self._ttft),
            direction=self._direction,
            reason=self._reason,
            adjustments=self._adjustments,
        )

    # ------------------------------------------------------------------ internals

    def _monotonic(self, now: float) -> float:
        # A caller's clock that steps back must not un-age samples: time only moves forward here.
        self._last = max(self._last, now)
        return self._last

    def _p99(self, window: _Window) -> float | None:
        return window.p99() if len(window) >= self._s.min_samples else None

    def _tick(self, now: float) -> None:
        s = self._s
        self._tpot.evict(now)
        self._ttft.evict(now)
        tpot = self._p99(self._tpot)
        ttft = self._p99(self._ttft)
        if (s.tpot_p99_ms is not None and tpot is None) or (s.ttft_p99_ms is not None and ttft is None):
            self._set("hold", "too_few_samples")
            return
        up, down = 1.0 + s.step, 1.0 / (1.0 + s.step)
        h = s.hysteresis
        tpot_over = s.tpot_p99_ms is not None and tpot is not None and tpot > s.tpot_p99_ms
        tpot_room = s.tpot_p99_ms is None or (tpot is not None and tpot < s.tpot_p99_ms * (1 - 2 * h))
        ttft_over = s.ttft_p99_ms is not None and ttft is not None and ttft > s.ttft_p99_ms
        ttft_room = s.ttft_p99_ms is None or (ttft is not None and ttft < s.ttft_p99_ms * (1 - 2 * h))
        if tpot_over:
            self._move(min(self._w_tpot * up, s.w_tpot_max), "tpot_over")
        elif tpot_room and ttft_over:
            self._move(max(self._w_tpot * down, s.w_tpot_min), "ttft_over")
        elif tpot_room and ttft_room:
            if self._w_tpot > self._base_tpot:
                target = max(self._w_tpot * down, self._base_tpot)
                if target < self._good and now - self._last_up < self._relax_wait:
                    self._set("hold", "relax_wait")
                else:
                    self._relaxed_from = self._w_tpot
                    self._move(target, "relax")
            elif self._w_tpot < self._base_tpot:
                self._move(min(self._w_tpot * up, self._base_tpot), "relax")
            else:
                self._good, self._relax_wait = self._base_tpot, 0.0
                self._set("hold", "at_base")
            return
        else:
            self._set("hold", "in_band")
            return
        if self._direction == "up":
            self._last_up = now

    def _move(self, w_tpot: float, reason: str) -> None:
        if w_tpot == self._w_tpot:
            self._set("hold", "at_bound")
            return
        direction: Direction = "up" if w_tpot > self._w_tpot else "down"
        if reason == "tpot_over" and self._last_move == "relax":
            # Rule 5: that relax went past the flip point.
            window = self._s.window_s
            self._good = self._relaxed_from
            self._relax_wait = min(max(2.0 * self._relax_wait, window), 16.0 * window)
        self._set(direction, reason)
        self._last_move = reason
        self._w_tpot = w_tpot
        self._adjustments += 1
        # Rule 4: what the windows hold was measured under the old weight.
        self._moved_at = self._last
        self._tpot.clear()
        self._ttft.clear()

    def _set(self, direction: Direction, reason: str) -> None:
        self._direction = direction
        self._reason = reason

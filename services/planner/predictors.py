"""Load predictors: the next interval's load from the intervals observed so far."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

from services.planner.sizing import Load

PredictorName = Literal["constant", "ema"]


class LoadPredictor(ABC):
    """The seam between what the planner measured and what it sizes the pools for.

    The planner calls :meth:`observe` once per interval with that interval's measured load
    (never with an interval whose figures were missing), then :meth:`predict` for the load to
    size the next interval for. A predictor holds only what it learned from :meth:`observe`;
    it reads no metrics and never raises on a well-formed :class:`Load`.
    """

    @abstractmethod
    def observe(self, load: Load) -> None:
        """Learn one interval's measured load (called in interval order)."""

    @abstractmethod
    def predict(self) -> Load | None:
        """The load expected in the next interval; ``None`` before any :meth:`observe`."""


class ConstantPredictor(LoadPredictor):
    """The next interval repeats the last one."""

    def __init__(self) -> None:
        self._last: Load | None = None

    def observe(self, load: Load) -> None:
        self._last = load

    def predict(self) -> Load | None:
        return self._last


class EmaPredictor(LoadPredictor):
    """An exponential moving average of each figure: ``alpha * new + (1 - alpha) * old``
    (the first observation is taken as it is). ``alpha`` in ``(0, 1]``; 1 is constant."""

    def __init__(self, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._average: Load | None = None

    def observe(self, load: Load) -> None:
        old = self._average
        if old is None:
            self._average = load
            return
        a = self.alpha
        self._average = Load(
            rate_rps=a * load.rate_rps + (1 - a) * old.rate_rps,
            input_tokens=a * load.input_tokens + (1 - a) * old.input_tokens,
            output_tokens=a * load.output_tokens + (1 - a) * old.output_tokens,
            cached_tokens=a * load.cached_tokens + (1 - a) * old.cached_tokens,
        )

    def predict(self) -> Load | None:
        return self._average


def make_predictor(name: PredictorName, alpha: float) -> LoadPredictor:
    """The predictor ``--predictor`` names (``alpha`` only for ``ema``)."""
    if name == "ema":
        return EmaPredictor(alpha)
    return ConstantPredictor()

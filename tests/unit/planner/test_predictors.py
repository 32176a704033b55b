"""The load predictors: constant repeats the last interval, ema smooths each figure."""

from __future__ import annotations

import pytest

from services.planner.predictors import (
    ConstantPredictor,
    EmaPredictor,
    LoadPredictor,
    make_predictor,
)
from services.planner.sizing import Load


def test_constant_predicts_the_last_interval() -> None:
    predictor = ConstantPredictor()
    assert predictor.predict() is None
    predictor.observe(Load(4, 100, 10))
    predictor.observe(Load(8, 200, 20))
    assert predictor.predict() == Load(8, 200, 20)


def test_ema_weights_the_newest_interval_by_alpha() -> None:
    predictor = EmaPredictor(alpha=0.25)
    assert predictor.predict() is None
    predictor.observe(Load(8, 100, 40))  # the first is taken as it is
    assert predictor.predict() == Load(8, 100, 40)
    predictor.observe(Load(16, 500, 0))
    assert predictor.predict() == Load(10, 200, 30)  # 0.25 * new + 0.75 * old


def test_ema_of_alpha_one_is_constant() -> None:
    ema, constant = EmaPredictor(1.0), ConstantPredictor()
    for load in (Load(1, 10, 5), Load(7, 30, 2), Load(3, 20, 9)):
        ema.observe(load)
        constant.observe(load)
        assert ema.predict() == constant.predict()


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.5])
def test_ema_refuses_an_alpha_outside_0_1(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha"):
        EmaPredictor(alpha)


def test_make_predictor_builds_the_named_one() -> None:
    ema: LoadPredictor = make_predictor("ema", 0.3)
    assert isinstance(ema, EmaPredictor)
    assert ema.alpha == 0.3
    assert isinstance(make_predictor("constant", 0.3), ConstantPredictor)

"""The chart, loaded once per module for the tests that render it."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import pytest

from tests.deploy.chart import CHART_DIR


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded

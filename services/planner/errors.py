"""The planner's errors.

::

    PlannerError
    ├── MetricsUnreadable   one interval's figures could not be read (held, counted, retried)
    └── PlannerConfigError  settings or a profile it cannot plan with (exit 2 at start)
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base of the planner's errors."""


class MetricsUnreadable(PlannerError):
    """The router's ``/metrics`` could not be fetched or parsed this interval."""


class PlannerConfigError(PlannerError):
    """Settings or a profile the planner cannot plan with."""

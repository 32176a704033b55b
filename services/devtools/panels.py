"""Evaluate every panel of a Grafana dashboard through a real Prometheus, as Grafana would.

Grafana sends each panel target to Prometheus's ``/api/v1/query_range`` after substituting its
variables; a panel shows "No data" when every target comes back empty. :func:`evaluate_dashboard`
does the same for a dashboard model:

- template variables (``label_values(selector, label)`` queries) are resolved against the same
  Prometheus (``/api/v1/series``) in their order, each one's selector seeing the variables
  before it, and set to "All" (the variable's ``allValue``, else a regex of every value);
- ``$__interval`` is the step, ``$__range`` the range, and ``$__rate_interval`` Grafana's
  ``max($__interval + scrape interval, 4 x scrape interval)``;
- each panel's targets run over ``[start, end]``; the result says, per panel, how many series
  came back and the largest value seen.

``python -m services.devtools.panels --prometheus URL DASHBOARD.json...`` prints each panel of a
live system with what it shows (``EMPTY`` for none), e.g. against ``pdserve up --prometheus``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.devtools.dashboards import iter_panels, label_values_selector

_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.DOTALL)


class PrometheusQueryError(RuntimeError):
    """Prometheus refused a query (bad PromQL after substitution, or an API error)."""


@dataclass
class PanelResult:
    """What one panel shows over the evaluated range."""

    dashboard: str
    title: str
    queries: list[str] = field(default_factory=list)
    """The targets as sent, variables substituted."""
    series: int = 0
    """Series returned by all its targets together."""
    max_value: float = -math.inf
    """The largest finite value of any point (``-inf`` when there was none)."""

    @property
    def empty(self) -> bool:
        return self.series == 0


class PrometheusAPI:
    """The few calls of Prometheus's HTTP API that Grafana's panels and the tests need."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)

    def close(self) -> None:
        self._client.close()

    def _get(self, path: str, params: Mapping[str, Any]) -> Any:
        response = self._client.get(path, params=params)
        try:
            body = response.json()
        except ValueError as exc:
            raise PrometheusQueryError(f"{path}: HTTP {response.status_code}") from exc
        if body.get("status") != "success":
            raise PrometheusQueryError(f"{path} {dict(params)}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (``[{"metric": {...}, "value": [t, "v"]}, ...]``)."""
        data = self._get("/api/v1/query", {"query": expr})
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(
        self, expr: str, start: float, end: float, step_s: float
    ) -> list[dict[str, Any]]:
        data = self._get(
            "/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step_s}
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def label_values(self, selector: str, label: str, start: float, end: float) -> list[str]:
        series = self._get("/api/v1/series", {"match[]": selector, "start": start, "end": end})
        return sorted({str(s[label]) for s in series if label in s})

    def alerts(self) -> list[dict[str, Any]]:
        data = self._get("/api/v1/alerts", {})
        alerts: list[dict[str, Any]] = data["alerts"]
        return alerts

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets, each with its ``health``, ``lastError`` and
        ``lastScrape``."""
        data = self._get("/api/v1/targets", {"state": "active"})
        targets: list[dict[str, Any]] = data["activeTargets"]
        return targets

    def rule_groups(self) -> list[dict[str, Any]]:
        """The rule groups, each with its ``lastEvaluation`` and its rules' ``health``."""
        data = self._get("/api/v1/rules", {})
        groups: list[dict[str, Any]] = data["groups"]
        return groups


def interval_variables(step_s: float, scrape_interval_s: float, range_s: float) -> dict[str, str]:
    """Grafana's built-in interval variables for a panel of ``range_s`` at ``step_s``."""
    rate_interval = max(step_s + scrape_interval_s, 4 * scrape_interval_s)
    return {
        "__interval": _duration(step_s),
        "__rate_interval": _duration(rate_interval),
        "__range": _duration(range_s),
    }


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with ``$name`` / ``${name}`` / ``${name:format}`` replaced; an unknown variable
    raises ``KeyError`` naming it."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"dashboard variable ${name} has no value")
        return variables[name]

    return _VARIABLE.sub(replace, expr)


def resolve_variables(
    dashboard: Mapping[str, Any],
    api: PrometheusAPI,
    start: float,
    end: float,
    base: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Every template variable set to "All", and the values each query variable offers."""
    variables = dict(base)
    offered: dict[str, list[str]] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        name = str(variable.get("name"))
        if variable.get("type") == "datasource":
            variables[name] = "prometheus"
            continue
        if variable.get("type") != "query":
            raise ValueError(f"variable {name}: unsupported type {variable.get('type')!r}")
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, Mapping) else str(query or "")
        match = _LABEL_VALUES.match(text)
        selector = label_values_selector(text)
        if match is None or selector is None:
            raise ValueError(f"variable {name}: only label_values(selector, label): {text!r}")
        label = match.group("args").rpartition(",")[2].strip()
        values = api.label_values(substitute(selector, variables), label, start, end)
        offered[name] = values
        all_value = variable.get("allValue")
        variables[name] = (
            str(all_value) if all_value else "(" + "|".join(re.escape(v) for v in values) + ")"
        )
    return variables, offered


def evaluate_dashboard(
    dashboard: Mapping[str, Any],
    api: PrometheusAPI,
    *,
    start: float,
    end: float,
    step_s: float,
    scrape_interval_s: float,
) -> tuple[list[PanelResult], dict[str, list[str]]]:
    """Every panel with targets, evaluated over ``[start, end]``, and each variable's values."""
    base = interval_variables(step_s, scrape_interval_s, end - start)
    variables, offered = resolve_variables(dashboard, api, start, end, base)
    title = str(dashboard.get("title", "?"))
    results = []
    for panel in iter_panels(dashboard.get("panels", [])):
        targets = [t for t in panel.get("targets", []) if t.get("expr")]
        if not targets:
            continue
        result = PanelResult(title, str(panel.get("title", "?")))
        for target in targets:
            expr = substitute(str(target["expr"]), variables)
            result.queries.append(expr)
            for series in api.query_range(expr, start, end, step_s):
                result.series += 1
                for _, value in series.get("values", []):
                    number = float(value)
                    if math.isfinite(number):
                        result.max_value = max(result.max_value, number)
        results.append(result)
    return results, offered


def main(argv: Sequence[str] | None = None) -> int:
    """Print what every panel of the dashboards shows on a live Prometheus."""
    parser = argparse.ArgumentParser(prog="python -m services.devtools.panels")
    parser.add_argument("dashboards", nargs="+", type=Path)
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=15.0, help="range ending now")
    parser.add_argument("--scrape-interval-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    end = time.time()
    start = end - args.minutes * 60
    step = max(args.scrape_interval_s, (end - start) / 300)
    api = PrometheusAPI(args.prometheus)
    empty = 0
    try:
        for path in args.dashboards:
            results, _ = evaluate_dashboard(
                json.loads(path.read_text()),
                api,
                start=start,
                end=end,
                step_s=step,
                scrape_interval_s=args.scrape_interval_s,
            )
            for result in results:
                shown = "EMPTY" if result.empty else f"{result.series} series"
                empty += result.empty
                print(f"{result.dashboard} | {result.title}: {shown}")
    finally:
        api.close()
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())

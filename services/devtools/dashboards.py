"""Series named by the Grafana dashboards, the metric catalogue, and a live ``/metrics`` page.

The dashboards (``deploy/helm/pdserve/dashboards/*.json``), ``docs/metrics.md`` and the exporters
must agree on every series name; the tests in ``tests/deploy`` use these helpers to check that:

- :func:`dashboard_queries` lists every PromQL query of a dashboard: panel targets (rows'
  nested panels included) and ``label_values(...)`` template variables;
- :func:`series_in_query` parses one query with a real PromQL parser (``promql-parser``, the Rust
  ``promql-parser`` crate's Python binding) after substituting Grafana's ``$variables``, and
  returns the series (metric names) it selects; a syntax error raises :class:`PromQLError`;
- :func:`catalogue_series` reads the catalogue's tables; :func:`exported_series` reads a
  Prometheus text exposition. Both return concrete series names, so a histogram ``x`` stands for
  ``x_bucket``, ``x_sum`` and ``x_count``.

``python -m services.devtools.dashboards FILE...`` prints the series each dashboard names.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# Grafana's built-in interval variables become durations; every other $variable sits inside a
# label matcher's regex in our dashboards and becomes ".*" (what "All" selects).
_INTERVAL_VARIABLES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
}
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.DOTALL)
_CATALOGUE_ROW = re.compile(r"^\|\s*`(?P<name>pdserve_[a-z0-9_]+)`\s*\|\s*(?P<type>[a-z]+)")


class PromQLError(ValueError):
    """A dashboard query that does not parse as PromQL; the message names the query."""


@dataclass(frozen=True)
class DashboardQuery:
    """One PromQL query of a dashboard and where it is."""

    dashboard: str
    """The dashboard's title."""
    location: str
    """``panel "<title>" target A`` or ``variable <name>``."""
    expr: str
    """The query as written in the JSON (Grafana variables included)."""


def dashboard_queries(dashboard: Mapping[str, Any]) -> list[DashboardQuery]:
    """Every PromQL query of a Grafana dashboard model: panel targets and query variables.

    A ``label_values(selector, label)`` variable contributes its selector; ``label_values(label)``
    names no series and contributes nothing.
    """
    title = str(dashboard.get("title", "?"))
    queries: list[DashboardQuery] = []
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            expr = target.get("expr")
            if expr:
                location = f'panel "{panel.get("title", "?")}" target {target.get("refId", "?")}'
                queries.append(DashboardQuery(title, location, str(expr)))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, Mapping) else str(query or "")
        selector = label_values_selector(text)
        if selector:
            queries.append(DashboardQuery(title, f"variable {variable.get('name')}", selector))
    return queries


def iter_panels(panels: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """Every panel, rows' nested panels included, in dashboard order."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def label_values_selector(text: str) -> str | None:
    """The selector of a ``label_values(selector, label)`` variable query (``None`` for
    ``label_values(label)``); :class:`PromQLError` for any other kind of query."""
    match = _LABEL_VALUES.match(text)
    if match is None:
        if text.strip():
            raise PromQLError(f"unsupported variable query (only label_values): {text!r}")
        return None
    args = match.group("args")
    selector, _, label = args.rpartition(",")
    return selector.strip() or None if label.strip() else None


def substitute_variables(expr: str) -> str:
    """``expr`` with Grafana variables replaced so that a PromQL parser accepts it."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return _INTERVAL_VARIABLES.get(name, ".*")

    return _VARIABLE.sub(replace, expr)


def series_in_query(expr: str) -> set[str]:
    """The metric names a query selects, parsed by a real PromQL parser.

    Raises:
        PromQLError: the query (after variable substitution) is not valid PromQL, or selects a
            series without naming it (``{job="x"}``), which no catalogue check could cover.
    """
    # Imported here: a dev dependency, needed only by these checks.
    import promql_parser  # noqa: PLC0415

    text = substitute_variables(expr)
    try:
        tree = promql_parser.parse(text)
    except Exception as exc:  # the binding raises plain ValueError/RuntimeError with a message
        raise PromQLError(f"not valid PromQL: {exc}\n  query: {text}") from exc
    names: set[str] = set()
    anonymous: list[str] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or _name_matcher(node)
            if name:
                names.add(name)
            else:
                anonymous.append(str(node))

    promql_parser.walk(tree, visit)
    if anonymous:
        raise PromQLError(f"selector without a metric name {anonymous[0]} in: {text}")
    return names


def _name_matcher(node: Any) -> str | None:
    for matcher in node.matchers.matchers:
        if matcher.name == "__name__" and str(matcher.op).endswith("Equal"):
            return str(matcher.value)
    return None


def catalogue_series(markdown: str) -> dict[str, set[str]]:
    """Metric name -> the concrete series it exports, from the tables of ``docs/metrics.md``.

    Rows look like ``| `pdserve_x_seconds` | histogram | labels |``.
    """
    catalogue: dict[str, set[str]] = {}
    for line in markdown.splitlines():
        match = _CATALOGUE_ROW.match(line)
        if match:
            name, kind = match.group("name"), match.group("type")
            catalogue[name] = _series_of(name, kind)
    return catalogue


def _series_of(name: str, kind: str) -> set[str]:
    if kind == "histogram":
        return {name + suffix for suffix in HISTOGRAM_SUFFIXES}
    if kind == "summary":
        return {name, name + "_sum", name + "_count"}
    if kind == "counter" and not name.endswith("_total"):
        return {name + "_total"}
    return {name}


def exported_series(exposition: str) -> set[str]:
    """Series a ``/metrics`` page declares, whether or not a labelled child has a sample yet.

    A family declared with ``# TYPE`` counts even without samples: a counter of failures exists
    (and is charted) before the first failure.
    """
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    series: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        series |= _series_of(family.name, family.type)
        series |= {sample.name for sample in family.samples}
    return series


def main(argv: Sequence[str] | None = None) -> int:
    """Print each dashboard's series, one per line, and fail on a query that does not parse."""
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m services.devtools.dashboards DASHBOARD.json...", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        dashboard = json.loads(Path(path).read_text())
        names: set[str] = set()
        for query in dashboard_queries(dashboard):
            try:
                names |= series_in_query(query.expr)
            except PromQLError as exc:
                print(f"{path}: {query.location}: {exc}", file=sys.stderr)
                status = 1
        print(f"# {path}")
        print("\n".join(sorted(names)))
    return status


if __name__ == "__main__":
    sys.exit(main())

"""docs/metrics.md says, for every metric, which dashboard panels and which alerts use it, and
says it right: the ``panels`` and ``alerts`` columns of its tables are checked against the
dashboards' queries and the rules file (an alert uses what its recording rules read), and every
alert has a runbook row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from services.devtools.dashboards import catalogue_series, dashboard_queries, series_in_query
from services.observability.local_prometheus import RULES_FILE
from tests.deploy.chart import DASHBOARDS

CATALOGUE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
_ROW = re.compile(r"^\|\s*`(?P<name>pdserve_[a-z0-9_]+)`\s*\|(?P<cells>.*)\|\s*$")
_PANEL = re.compile(r'^panel "(?P<title>.*)" target')


def used_by() -> dict[str, tuple[set[str], set[str]]]:
    """Catalogued metric -> (panel titles, alert names) that read it."""
    catalogue = catalogue_series(CATALOGUE.read_text())
    panels: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        for query in dashboard_queries(json.loads(path.read_text())):
            match = _PANEL.match(query.location)
            if match:
                for series in series_in_query(query.expr):
                    panels.setdefault(series, set()).add(match.group("title"))
    rules = [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    recorded = {str(r["record"]): str(r["expr"]) for r in rules if "record" in r}

    def reads(expr: str) -> set[str]:
        found: set[str] = set()
        for series in series_in_query(expr):
            found |= reads(recorded[series]) if series in recorded else {series}
        return found

    alerts: dict[str, set[str]] = {}
    for rule in rules:
        if "alert" in rule:
            for series in reads(str(rule["expr"])):
                alerts.setdefault(series, set()).add(str(rule["alert"]))
    return {
        name: (
            set().union(*(panels.get(s, set()) for s in series)),
            set().union(*(alerts.get(s, set()) for s in series)),
        )
        for name, series in catalogue.items()
    }


def documented() -> dict[str, tuple[set[str], set[str]]]:
    """Metric -> (panels, alerts) as the catalogue's last two columns name them."""
    rows: dict[str, tuple[set[str], set[str]]] = {}
    for line in CATALOGUE.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            cells = [c.strip() for c in match.group("cells").split("|")]
            panels, alerts = cells[-2], cells[-1]
            rows[match.group("name")] = (
                set(re.findall(r"“([^”]+)”", panels)),
                set(re.findall(r"`(Pdserve\w+)`", alerts)),
            )
    return rows


def test_the_catalogue_names_the_panels_and_alerts_of_every_metric() -> None:
    expected, written = used_by(), documented()
    assert set(written) == set(expected)
    wrong = {
        name: {"dashboards/rules": expected[name], "docs": written[name]}
        for name in expected
        if expected[name] != written[name]
    }
    assert wrong == {}, "docs/metrics.md panels/alerts columns out of date"


def test_every_alert_has_a_runbook_row() -> None:
    rules = [r for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    text = CATALOGUE.read_text()
    for rule in rules:
        if "alert" in rule:
            row = re.search(rf"^\| `{rule['alert']}` \|(.+)\|\s*$", text, re.MULTILINE)
            assert row, f"no row for {rule['alert']} in docs/metrics.md's Alerts table"
            assert all(cell.strip() for cell in row.group(1).split("|")), row.group(0)

"""The chart's recording and alert rules: valid for Prometheus, unit-tested, rendered, documented.

``promtool`` (Prometheus's own checker) validates ``rules/pdserve.rules.yaml`` and runs the unit
tests of ``tests/deploy/promtool/`` (input series -> expected alerts, labels and annotations).
promtool comes from ``PATH`` or the virtual environment (``make test`` installs it); without it
these tests fail saying how to install it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import helm_python as helm
import yaml

from services.devtools.dashboards import catalogue_series, series_in_query
from services.observability.local_prometheus import RULES_FILE, find_binary
from tests.deploy.chart import find, kinds, render, validate_manifest

PROMTOOL_TESTS = sorted((Path(__file__).parent / "promtool").glob("*.test.yaml"))
CATALOGUE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# What an operator of PD serving must be alerted on (the list).
REQUIRED_ALERTS = {
    "PdserveKVTransferLatencyHigh",
    "PdserveRouterFallbacks",
    "PdserveKVRecomputes",
    "PdserveKVLeasesExpiring",
    "PdserveKVTransferFailures",
    "PdserveEngineNotReady",
    "PdserveRouterServerErrors",
    "PdserveNoReadyPair",
}


def rules() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def promtool(*args: str, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(find_binary("promtool")), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_promtool_accepts_the_rules_file() -> None:
    output = promtool("check", "rules", str(RULES_FILE))
    assert f"SUCCESS: {len(rules())} rules found" in output, output


def test_the_alert_rules_pass_their_promtool_unit_tests() -> None:
    assert PROMTOOL_TESTS, "no tests/deploy/promtool/*.test.yaml"
    for path in PROMTOOL_TESTS:
        output = promtool("test", "rules", path.name, cwd=path.parent)
        assert "SUCCESS" in output, output


def test_every_required_alert_exists_and_is_unit_tested() -> None:
    alerts = {str(rule["alert"]) for rule in rules() if "alert" in rule}
    assert alerts >= REQUIRED_ALERTS, f"missing: {REQUIRED_ALERTS - alerts}"
    tested = {
        str(case["alertname"])
        for path in PROMTOOL_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts <= tested, f"alerts no promtool test shows firing: {alerts - tested}"


def test_rules_select_only_catalogued_series_and_are_documented() -> None:
    catalogue_text = CATALOGUE.read_text()
    exported = set().union(*catalogue_series(catalogue_text).values())
    recorded = {str(rule["record"]) for rule in rules() if "record" in rule}
    for rule in rules():
        unknown = series_in_query(str(rule["expr"])) - exported - recorded
        assert unknown == set(), f"{rule.get('alert') or rule.get('record')}: {unknown}"
        if "alert" in rule:
            assert f"`{rule['alert']}`" in catalogue_text, (
                f"docs/metrics.md has no runbook line for {rule['alert']}"
            )


def test_prometheus_rule_is_opt_in_and_renders_the_rules_file(chart: helm.Chart) -> None:
    assert "PrometheusRule" not in kinds(render(chart))
    manifests = render(
        chart, {"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}
    )
    rule = find(manifests, "PrometheusRule")
    assert validate_manifest(rule) == []
    assert rule.body["metadata"]["labels"]["release"] == "kps"
    assert rule.body["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text())["groups"]

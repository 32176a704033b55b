"""Bad values never render: values.schema.json rejects malformed ones (Helm enforces it) and the
``pdserve.validate`` helper rejects inconsistent ones, each with a message naming the problem."""

from __future__ import annotations

import copy
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart import CHART_DIR, render

SCHEMA_REJECTS = [
    pytest.param({"prefill": {"engine": "sglang"}}, "/prefill/engine", id="unknown-engine"),
    pytest.param({"decode": {"pp": 0}}, "/decode/pp", id="pp-zero"),
    pytest.param({"prefill": {"tp": 65}}, "/prefill/tp", id="tp-too-large"),
    pytest.param({"prefil": {"pp": 2}}, "'prefil' not allowed", id="typo-top-level"),
    pytest.param({"decode": {"gpus": 2}}, "'gpus' not allowed", id="typo-in-role"),
    pytest.param({"decode": {"shmSize": "16 GB"}}, "/decode/shmSize", id="bad-quantity"),
    pytest.param({"redis": {"mode": "sentinel"}}, "/redis/mode", id="unknown-redis-mode"),
    pytest.param({"router": {"policy": "random"}}, "/router/policy", id="unknown-policy"),
    pytest.param(
        {"prefill": {"ucx": {"extraEnv": {"NCCL_DEBUG": "INFO"}}}},
        "NCCL_DEBUG",
        id="non-ucx-variable-in-ucx",
    ),
    pytest.param({"model": {"path": "models/llama"}}, "/model/path", id="relative-model-path"),
    pytest.param(
        {"planner": {"prefill": {"minReplicas": 0}}},
        "/planner/prefill/minReplicas",
        id="planner-pool-min-zero",
    ),
    pytest.param(
        {"planner": {"autoscaling": {"mode": "vpa"}}},
        "/planner/autoscaling/mode",
        id="planner-unknown-mode",
    ),
    pytest.param(
        {"planner": {"decode": {"min": 2}}}, "'min' not allowed", id="planner-typo-in-bounds"
    ),
    pytest.param(
        {"planner": {"autoscaling": {"keda": {"serverAddress": "prometheus:9090"}}}},
        "/planner/autoscaling/keda/serverAddress",
        id="planner-prometheus-without-scheme",
    ),
    pytest.param(
        {"planner": {"autoscaling": {"scaleDown": {"pods": 0}}}},
        "/planner/autoscaling/scaleDown/pods",
        id="planner-scale-down-zero-pods",
    ),
    pytest.param({"planner": {"predictor": "arima"}}, "/planner/predictor", id="planner-predictor"),
]

# The planner on, with what it needs: a Prometheus for KEDA.
PLANNER_ON: dict[str, Any] = {
    "planner": {
        "enabled": True,
        "autoscaling": {"keda": {"serverAddress": "http://prometheus:9090"}},
    },
}


def with_planner(**planner: Any) -> dict[str, Any]:
    values = copy.deepcopy(PLANNER_ON)
    for key, value in planner.items():
        if isinstance(value, dict):
            values["planner"].setdefault(key, {}).update(value)
        else:
            values["planner"][key] = value
    return values


VALIDATE_REJECTS = [
    pytest.param(
        {"prefill": {"pp": 4, "tp": 8, "multiNode": {"enabled": True, "nodes": 4}}},
        ["prefill.multiNode.enabled=true needs leaderWorkerSet.enabled=true"],
        id="multi-node-without-lws",
    ),
    pytest.param(
        {
            "leaderWorkerSet": {"enabled": True},
            "decode": {"engine": "reference", "multiNode": {"enabled": True, "nodes": 2}},
        },
        ["decode.multiNode.enabled=true needs decode.engine=vllm"],
        id="multi-node-reference-engine",
    ),
    pytest.param(
        {
            "leaderWorkerSet": {"enabled": True},
            "prefill": {"pp": 2, "tp": 1, "multiNode": {"enabled": True, "nodes": 3}},
        },
        ["prefill: pp * tp = 2 GPUs cannot be split evenly over multiNode.nodes=3"],
        id="uneven-node-split",
    ),
    pytest.param(
        {"redis": {"mode": "external", "external": {"existingSecret": "s"}}},
        ["redis.mode=external needs redis.external.url"],
        id="external-redis-without-url",
    ),
    pytest.param(
        {"redis": {"mode": "external", "external": {"url": "redis://r:6379/0"}}},
        ["redis.mode=external needs redis.external.existingSecret"],
        id="external-redis-without-secret",
    ),
    pytest.param(
        {
            "redis": {
                "mode": "external",
                "external": {"url": "http://r:6379", "existingSecret": "s"},
            }
        },
        ['redis.external.url="http://r:6379" must start with redis://'],
        id="external-redis-bad-scheme",
    ),
    pytest.param(
        {"prefill": {"terminationGracePeriodSeconds": 60}},
        [
            "prefill.terminationGracePeriodSeconds=60 must exceed drain.timeoutSeconds + "
            "kvLeaseSeconds = 90"
        ],
        id="grace-period-shorter-than-drain-and-lease",
    ),
    pytest.param(
        {"decode": {"readyTimeoutSeconds": 1200}},
        ["decode.readyTimeoutSeconds=1200 exceeds the startup probe's window"],
        id="ready-timeout-beyond-startup-probe",
    ),
    pytest.param(
        {"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}},
        ["scraped twice"],
        id="both-monitors",
    ),
    pytest.param(
        {"controlPlane": {"leaseTtlSeconds": 4, "heartbeatIntervalSeconds": 3}},
        ["controlPlane.heartbeatIntervalSeconds=3 must be at most half"],
        id="heartbeat-too-slow-for-lease",
    ),
    pytest.param(
        {"router": {"replicas": 1}},
        ["router.podDisruptionBudget.minAvailable=1 must be below the router's replicas (1)"],
        id="pdb-blocks-every-drain",
    ),
    pytest.param(
        {"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 3}}},
        ["router.autoscaling.minReplicas=5 is above maxReplicas=3"],
        id="hpa-min-above-max",
    ),
    pytest.param(
        {"decode": {"enabled": False}}, ["the router needs decode engines"], id="no-decode"
    ),
    pytest.param(
        with_planner(prefill={"minReplicas": 5, "maxReplicas": 3}),
        ["planner.prefill.minReplicas=5 is above maxReplicas=3"],
        id="planner-min-above-max",
    ),
    pytest.param(
        with_planner(autoscaling={"keda": {"serverAddress": ""}}),
        ["planner.autoscaling.mode=keda needs planner.autoscaling.keda.serverAddress"],
        id="planner-keda-without-prometheus",
    ),
    pytest.param(
        with_planner(profileJson="{not json"),
        ["planner.profileJson is not a profile"],
        id="planner-profile-not-json",
    ),
    pytest.param(
        with_planner(profileJson='{"name": "x"}'),
        ["planner.profileJson is not a profile"],
        id="planner-profile-without-version",
    ),
    pytest.param(
        {"lora": {"enabled": True}, "prefill": {"engine": "reference"}},
        ["lora.enabled=true (or lora.modules) needs prefill.engine=vllm"],
        id="lora-on-reference-engines",
    ),
    pytest.param(
        {
            "redis": {"mode": "external"},
            "prefill": {"multiNode": {"enabled": True, "nodes": 2}, "engine": "reference"},
        },
        [
            "prefill.multiNode.enabled=true needs leaderWorkerSet.enabled=true",
            "prefill.multiNode.enabled=true needs prefill.engine=vllm",
            "redis.mode=external needs redis.external.url",
            "redis.mode=external needs redis.external.existingSecret",
        ],
        id="every-problem-listed-at-once",
    ),
]


@pytest.mark.parametrize(("values", "where"), SCHEMA_REJECTS)
def test_the_schema_rejects_malformed_values(
    chart: helm.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as raised:
        render(chart, values)
    message = str(raised.value)
    assert "values don't meet the specifications of the schema" in message
    assert where in message


@pytest.mark.parametrize(("values", "expected"), VALIDATE_REJECTS)
def test_the_validate_helper_rejects_inconsistent_values(
    chart: helm.Chart, values: dict[str, Any], expected: list[str]
) -> None:
    chart.validate_schema(values)  # well-formed: only the cross-field rules object
    with pytest.raises(helm.HelmRenderError) as raised:
        render(chart, values)
    message = str(raised.value)
    assert "pdserve: invalid values:" in message
    for line in expected:
        assert line in message
    assert message.count("\n  - ") == len(expected)


def test_helm_lint_reports_schema_violations() -> None:
    report = helm.lint(str(CHART_DIR), {"prefill": {"engine": "sglang"}})
    assert any("/prefill/engine" in m["error"] for m in report["messages"] if m["severity"] == 3)

"""The planner on Kubernetes: the chart ships ``pdserve planner`` (Deployment, metrics Service,
its own token-less ServiceAccount, no Role) and, per pool, a KEDA ScaledObject or an HPA on an
External metric that sets the pool's workload to ``pdserve_planner_desired_replicas{pool}``.
Rendered with the real Helm engine, validated like every other object (the ScaledObject against
``crd_schemas/scaledobject-keda.sh-v1alpha1.json``), and the rendered planner command run for real:
its flags parse and its ``/metrics`` exports the series the autoscalers' queries select."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.cli.main import build_parser
from services.cli.planner import build_settings
from services.engines.sim.profile import parse_profile, resolve_profile_path
from services.observability.local_prometheus import find_binary
from services.planner.main import build_planner
from services.serving.ready import parse_ready_line, pdserve_argv
from tests.deploy.chart import (
    CHART_DIR,
    NAMESPACE,
    Manifest,
    container,
    find,
    kinds,
    load_values,
    notes,
    pod_specs,
    render,
    validate_manifest,
)

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
AUTOSCALER_KINDS = {"ScaledObject", "HorizontalPodAutoscaler"}
PLANNER_START_TIMEOUT_S = 60.0


def planner_values(**planner: Any) -> dict[str, Any]:
    """Values with the planner on (KEDA, the default mode) and ``planner`` merged in."""
    merged: dict[str, Any] = {
        "enabled": True,
        "autoscaling": {"keda": {"serverAddress": PROMETHEUS}},
    }
    for key, value in planner.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return {"planner": merged}


def flags_of(args: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command line (after its subcommand)."""
    return dict(zip(args[1::2], args[2::2], strict=False))


def planner_args(manifests: list[Manifest]) -> list[str]:
    deployment = find(manifests, "Deployment", "-planner")
    return list(container(deployment.body["spec"]["template"])["args"])


def test_nothing_of_the_planner_renders_when_disabled(chart: helm.Chart) -> None:
    manifests = render(chart, {"prefill": {"replicas": 3}})
    assert not [m for m in manifests if "planner" in m.name]
    assert not kinds(manifests) & AUTOSCALER_KINDS
    # The pools keep their fixed sizes.
    assert find(manifests, "StatefulSet", "-prefill").body["spec"]["replicas"] == 3
    assert find(manifests, "StatefulSet", "-decode").body["spec"]["replicas"] == 1


def test_the_planner_deployment_carries_the_values_as_flags(chart: helm.Chart) -> None:
    values = planner_values(
        ttftMs=300,
        itlMs=25.5,
        intervalSeconds=15,
        predictor="ema",
        emaAlpha=0.3,
        inputTokens=2048,
        outputTokens=128,
        stabilizationIntervals=4,
        kvUsageLimit=0.85,
        prefillQueueLimit=3,
        metricsPort=9500,
        prefill={"minReplicas": 2, "maxReplicas": 6},
        decode={"minReplicas": 1, "maxReplicas": 12},
        extraArgs=["--log-level=INFO"],
    )
    manifests = render(chart, values)
    args = planner_args(manifests)
    assert args[0] == "planner"
    assert args[-1] == "--log-level=INFO"
    flags = flags_of(args[:-1])
    assert flags == {
        "--router-url": "http://demo-pdserve-router-pods:8000",
        "--router-discovery": "dns",
        "--profile": "llama-3.1-8b-h100",
        "--ttft-ms": "300",
        "--itl-ms": "25.5",
        "--interval-s": "15",
        "--predictor": "ema",
        "--ema-alpha": "0.3",
        "--input-tokens": "2048",
        "--output-tokens": "128",
        "--prefill-min": "2",
        "--prefill-max": "6",
        "--decode-min": "1",
        "--decode-max": "12",
        "--stabilization-intervals": "4",
        "--kv-usage-limit": "0.85",
        "--prefill-queue-limit": "3",
        "--metrics-host": "0.0.0.0",
        "--metrics-port": "9500",
    }
    # The router URL names a headless Service of every router pod, on the routers' own port.
    routers = find(manifests, "Service", "-router-pods").body["spec"]
    assert routers["clusterIP"] == "None"
    assert routers["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    router = find(manifests, "Deployment", "-router").body["spec"]
    assert routers["selector"] == router["selector"]["matchLabels"]
    assert container(router["template"])["ports"][0] == {"name": "http", "containerPort": 8000}
    # Its metrics Service: the port the monitors scrape, selected like every serving target.
    service = find(manifests, "Service", "-planner").body
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9500, "targetPort": "metrics"}]
    assert service["metadata"]["labels"]["pdserve.io/serving"] == "true"
    pod = find(manifests, "Deployment", "-planner").body["spec"]["template"]
    assert pod["metadata"]["labels"]["pdserve.io/serving"] == "true"
    assert container(pod)["ports"] == [{"name": "metrics", "containerPort": 9500}]


def test_the_rendered_planner_command_is_one_the_planner_accepts(chart: helm.Chart) -> None:
    """The chart's flags parse with ``pdserve planner``'s own parser and settings, and the profile
    they name loads: a renamed flag or a bound the planner refuses fails here, not in a pod."""
    values = planner_values(prefill={"minReplicas": 2, "maxReplicas": 5}, predictor="ema")
    args = planner_args(render(chart, values))
    settings = build_settings(build_parser().parse_args(args))
    assert (settings.prefill_min, settings.prefill_max) == (2, 5)
    assert settings.predictor == "ema"
    assert settings.router_url == "http://demo-pdserve-router-pods:8000"
    assert settings.router_discovery == "dns"
    assert settings.metrics_host == "0.0.0.0"
    # The engines' own figures: the chart's defaults are the planner's.
    assert settings.kv_usage_limit == 0.9 and settings.prefill_queue_limit is None
    build_planner(settings)  # the shipped profile name resolves and loads
    limited = planner_values(kvUsageLimit=1, prefillQueueLimit=0.5)
    settings = build_settings(build_parser().parse_args(planner_args(render(chart, limited))))
    assert (settings.kv_usage_limit, settings.prefill_queue_limit) == (1.0, 0.5)


def test_the_planner_reads_each_worker_of_every_router_pod(chart: helm.Chart) -> None:
    values = {**planner_values(), "router": {"workers": 3, "workerMetricsPort": 9300}}
    values["router"]["autoscaling"] = {"enabled": True, "minReplicas": 2, "maxReplicas": 6}
    args = planner_args(render(chart, values))
    ports = [args[i + 1] for i, arg in enumerate(args) if arg == "--router-metrics-port"]
    assert ports == ["9300", "9301", "9302"]
    settings = build_settings(build_parser().parse_args(args))
    assert settings.router_metrics_ports == [9300, 9301, 9302]
    assert "--router-metrics-port" not in planner_args(render(chart, planner_values()))


def test_the_planner_has_no_kubernetes_api_access(chart: helm.Chart) -> None:
    manifests = render(chart, planner_values())
    account = find(manifests, "ServiceAccount", "-planner").body
    assert account["automountServiceAccountToken"] is False
    pod = find(manifests, "Deployment", "-planner").body["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False
    assert not kinds(manifests) & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    assert container({"spec": pod})["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("mode", ["keda", "hpa"])
def test_every_planner_object_is_valid_and_lint_is_clean(chart: helm.Chart, mode: str) -> None:
    values = planner_values(autoscaling={"mode": mode, "keda": {"serverAddress": PROMETHEUS}})
    values["metrics"] = {"podMonitor": {"enabled": True}}
    manifests = render(chart, values)
    assert {"Deployment", "ServiceAccount"} <= kinds(manifests)
    problems = [line for m in manifests for line in validate_manifest(m)]
    assert problems == []
    report = helm.lint(str(CHART_DIR), values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_a_keda_scaled_object_per_pool_targets_its_statefulset_on_its_pool(
    chart: helm.Chart,
) -> None:
    values = planner_values(
        prefill={"minReplicas": 2, "maxReplicas": 6},
        decode={"minReplicas": 1, "maxReplicas": 10},
        autoscaling={
            "keda": {
                "serverAddress": PROMETHEUS,
                "pollingIntervalSeconds": 15,
                "extraLabels": {"cluster": "gpu-a"},
                "authenticationRef": "prometheus-auth",
            },
            "scaleDown": {"stabilizationWindowSeconds": 600, "pods": 1, "periodSeconds": 180},
        },
    )
    manifests = render(chart, values)
    assert "HorizontalPodAutoscaler" not in kinds(manifests)
    for pool, (low, high) in (("prefill", (2, 6)), ("decode", (1, 10))):
        scaled = find(manifests, "ScaledObject", f"-{pool}").body["spec"]
        assert scaled["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "name": f"demo-pdserve-{pool}",
        }
        find(manifests, "StatefulSet", f"-{pool}")  # the target exists under that name
        assert (scaled["minReplicaCount"], scaled["maxReplicaCount"]) == (low, high)
        assert scaled["pollingInterval"] == 15
        assert "fallback" not in scaled  # no figure: keep the replicas, never a fallback size
        behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"] == {
            "stabilizationWindowSeconds": 600,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 180}],
        }
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        (trigger,) = scaled["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue"
        assert trigger["authenticationRef"] == {"name": "prometheus-auth"}
        metadata = trigger["metadata"]
        assert metadata["serverAddress"] == PROMETHEUS
        assert metadata["threshold"] == "1"  # one replica per unit: replicas = the figure
        assert metadata["ignoreNullValues"] == "false"  # a lost series is an error, not 0
        release = {
            "namespace": ("=", NAMESPACE),
            "pod": ("=~", "demo-pdserve-planner-.+"),
            "pool": ("=", pool),
            "cluster": ("=", "gpu-a"),
        }
        assert selectors_of(metadata["query"]) == {
            "pdserve_planner_desired_replicas": release,
            # The gate: the planner has decided on the router's figures.
            "pdserve_planner_decisions_total": {**release, "reason": ("!=", "no_metrics")},
        }
        assert metadata["query"].startswith("max(")


def test_the_hpa_alternative_scales_each_pool_on_the_external_metric(chart: helm.Chart) -> None:
    values = planner_values(
        decode={"minReplicas": 3, "maxReplicas": 9},
        autoscaling={
            "mode": "hpa",
            "hpa": {
                "metricName": "pdserve_planner_desired_replicas",
                "extraMatchLabels": {"service": "demo-pdserve-planner", "pool": "overridden"},
            },
        },
    )
    manifests = render(chart, values)
    assert "ScaledObject" not in kinds(manifests)
    for pool, (low, high) in (("prefill", (1, 8)), ("decode", (3, 9))):
        hpa = find(manifests, "HorizontalPodAutoscaler", f"-{pool}")
        assert validate_manifest(hpa) == []
        spec = hpa.body["spec"]
        assert spec["scaleTargetRef"]["kind"] == "StatefulSet"
        assert spec["scaleTargetRef"]["name"] == f"demo-pdserve-{pool}"
        assert (spec["minReplicas"], spec["maxReplicas"]) == (low, high)
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"] == {
            "name": "pdserve_planner_desired_replicas",
            "selector": {"matchLabels": {"pool": pool, "service": "demo-pdserve-planner"}},
        }
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
        assert spec["behavior"]["scaleDown"]["policies"] == [
            {"type": "Pods", "value": 1, "periodSeconds": 120}
        ]


def test_scaled_pools_leave_replicas_to_the_autoscaler_within_bounds(chart: helm.Chart) -> None:
    """Rendered offline (no live object to look up), a scaled pool starts within its bounds."""
    values = planner_values(decode={"minReplicas": 2, "maxReplicas": 4})
    values["prefill"] = {"replicas": 12}
    manifests = render(chart, values)
    assert find(manifests, "StatefulSet", "-prefill").body["spec"]["replicas"] == 8
    assert find(manifests, "StatefulSet", "-decode").body["spec"]["replicas"] == 2


def test_scale_down_goes_through_the_engines_drain(chart: helm.Chart) -> None:
    """What an autoscaler removes drains: prefill's preStop holds the pod for drain + KV lease,
    decode drains on SIGTERM, and both grace periods exceed that bound."""
    manifests = render(chart, planner_values())
    for pool in ("prefill", "decode"):
        workload = find(manifests, "StatefulSet", f"-{pool}")
        (_, pod), *_ = pod_specs(workload)
        role = load_values(CHART_DIR / "values.yaml")[pool]
        bound = role["drain"]["timeoutSeconds"] + role["kvLeaseSeconds"]
        assert pod["spec"]["terminationGracePeriodSeconds"] > bound
        hook = container(pod).get("lifecycle", {}).get("preStop")
        assert (hook is not None) == (pool == "prefill")


def test_a_multi_node_pool_scales_its_leader_worker_set(chart: helm.Chart) -> None:
    values = {
        **load_values(CHART_DIR / "examples" / "multi-node-lws.yaml"),
        **planner_values(autoscaling={"mode": "hpa"}),
    }
    manifests = render(chart, values)
    hpa = find(manifests, "HorizontalPodAutoscaler", "-prefill").body["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "demo-pdserve-prefill",
    }
    assert find(manifests, "LeaderWorkerSet", "-prefill").body["spec"]["replicas"] == 1
    assert [line for m in manifests for line in validate_manifest(m)] == []


def test_no_autoscaler_for_a_disabled_pool(chart: helm.Chart) -> None:
    values = planner_values()
    values["prefill"] = {"enabled": False}
    manifests = render(chart, values)
    assert [m.name for m in manifests if m.kind == "ScaledObject"] == ["demo-pdserve-decode"]


def test_a_profile_from_values_ships_in_a_configmap_the_planner_loads(
    chart: helm.Chart, tmp_path: Path
) -> None:
    profile_text = resolve_profile_path("llama-3.1-8b-h100").read_text()
    manifests = render(chart, planner_values(profileJson=profile_text))
    config = find(manifests, "ConfigMap", "-planner-profile").body
    shipped = config["data"]["profile.json"]
    parse_profile(json.loads(shipped), origin="the chart's ConfigMap")
    pod = find(manifests, "Deployment", "-planner").body["spec"]["template"]
    flags = flags_of(container(pod)["args"])
    mount = container(pod)["volumeMounts"][0]
    assert mount["readOnly"] is True
    assert flags["--profile"] == f"{mount['mountPath']}/profile.json"
    (volume,) = pod["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    assert "checksum/profile" in pod["metadata"]["annotations"]
    # The planner loads the file the pod would see at that path.
    (tmp_path / "profile.json").write_text(shipped)
    local = str(tmp_path / "profile.json")
    args = [local if a == flags["--profile"] else a for a in container(pod)["args"]]
    build_planner(build_settings(build_parser().parse_args(args)))


def test_the_scaled_object_schema_catches_a_typo_and_a_missing_query(chart: helm.Chart) -> None:
    scaled = find(render(chart, planner_values()), "ScaledObject", "-decode")
    typo = copy.deepcopy(scaled.body)
    typo["spec"]["minReplicas"] = typo["spec"].pop("minReplicaCount")
    problems = validate_manifest(Manifest(scaled.template, typo))
    assert problems and "minReplicas" in problems[0]
    no_query = copy.deepcopy(scaled.body)
    del no_query["spec"]["triggers"][0]["metadata"]["query"]
    problems = validate_manifest(Manifest(scaled.template, no_query))
    assert problems and "'query' is a required property" in problems[0]


def test_the_running_planner_exports_what_the_scaled_objects_select(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """``pdserve planner`` started with the rendered flags (its router and port swapped for this
    machine) serves ``pdserve_planner_desired_replicas`` with the ``pool`` label each
    ScaledObject's query matches, at the pool's minimum while no router answers."""
    values = planner_values(
        prefill={"minReplicas": 2, "maxReplicas": 5}, decode={"minReplicas": 3, "maxReplicas": 7}
    )
    manifests = render(chart, values)
    args = planner_args(manifests)
    local = {"--router-url": "http://127.0.0.1:9", "--metrics-host": "127.0.0.1"}
    local["--metrics-port"] = "0"
    for flag, value in local.items():
        args[args.index(flag) + 1] = value
    with subprocess.Popen(
        pdserve_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as process:
        try:
            assert process.stdout is not None
            ready = parse_ready_line(process.stdout.readline())
            assert ready is not None, f"no ready line; exit code {process.poll()}"
            exposition = httpx.get(ready["metrics"], timeout=PLANNER_START_TIMEOUT_S).text
        finally:
            process.terminate()
            process.wait(timeout=PLANNER_START_TIMEOUT_S)
    samples = [
        sample for family in text_string_to_metric_families(exposition) for sample in family.samples
    ]
    for pool, minimum in (("prefill", 2), ("decode", 3)):
        query = find(manifests, "ScaledObject", f"-{pool}").body["spec"]["triggers"][0]
        selectors = selectors_of(query["metadata"]["query"])
        assert set(selectors) == {
            "pdserve_planner_desired_replicas",
            "pdserve_planner_decisions_total",
        }
        selected = {
            name: [s for s in samples if s.name == name and matches(s.labels, matchers)]
            for name, matchers in selectors.items()
        }
        (desired,) = selected["pdserve_planner_desired_replicas"]
        assert desired.value == minimum
        # The gate's series exist from the start and stay at 0 while no router answers: the
        # query selects nothing, so the pool keeps its replicas.
        gate = selected["pdserve_planner_decisions_total"]
        assert {s.labels["reason"] for s in gate} >= {"scale_up", "scale_down", "hold"}
        assert sum(s.value for s in gate) == 0


OPERATORS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~"}


def selectors_of(query: str) -> dict[str, dict[str, tuple[str, str]]]:
    """metric name -> {label: (operator, value)} of every vector selector in ``query`` (a real
    PromQL parser)."""
    selectors: dict[str, dict[str, tuple[str, str]]] = {}

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name not in selectors, f"{node.name} selected twice"
            selectors[node.name] = {
                m.name: (OPERATORS[str(m.op)], str(m.value)) for m in node.matchers.matchers
            }

    promql_parser.walk(promql_parser.parse(query), visit)
    return selectors


def matches(labels: dict[str, str], matchers: dict[str, tuple[str, str]]) -> bool:
    """Whether exported ``labels`` meet the matchers on labels the exporter sets (``pool``,
    ``reason``); those Prometheus adds at scrape time (``namespace``, ``pod``...) are skipped."""
    for name, (operator, value) in matchers.items():
        if name not in ("pool", "reason"):
            continue
        actual = labels.get(name, "")
        if (operator == "=" and actual != value) or (operator == "!=" and actual == value):
            return False
    return True


def test_notes_say_what_scales_the_pools_and_what_must_scrape_the_planner(
    chart: helm.Chart,
) -> None:
    assert "Planner" not in notes(chart)
    unscraped = notes(chart, planner_values())
    assert "KEDA ScaledObjects query " + PROMETHEUS in unscraped
    assert "add its Service demo-pdserve-planner (port metrics) to your Prometheus" in unscraped
    scraped = notes(chart, {**planner_values(), "metrics": {"podMonitor": {"enabled": True}}})
    assert "It must be scraped: by the PodMonitor above." in scraped


def test_prometheus_evaluates_the_scaled_object_query_as_intended(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """The rendered query run by Prometheus's own engine (``promtool test rules``) over series as
    the PodMonitor would store them: nothing before this release's planner has decided on the
    router's figures (a restarted planner publishes its bounds' view, and reads it could not make
    count as no_metrics), then its figure, never another release's or another namespace's, and
    nothing once its series went stale (the planner is gone)."""
    manifests = render(chart, planner_values())
    query = find(manifests, "ScaledObject", "-prefill").body["spec"]["triggers"][0]["metadata"]

    def series(name: str, pod: str, values: str, namespace: str = NAMESPACE, **labels: str) -> Any:
        fields = {"namespace": namespace, "pod": pod, "pool": "prefill", **labels}
        text = ",".join(f'{key}="{value}"' for key, value in fields.items())
        return {"series": f"{name}{{{text}}}", "values": values}

    desired = "pdserve_planner_desired_replicas"
    decisions = "pdserve_planner_decisions_total"
    ours = "demo-pdserve-planner-6c9f7-x2x4q"
    input_series = [
        # This release's planner: its minimum (1) until minute 3, when it decides 3; it could not
        # read the router in minutes 0 to 2 (no_metrics). Gone after minute 8 (stale).
        series(desired, ours, "1 1 1 3 3 3 3 3 3 stale"),
        series(decisions, ours, "1 2 3 3 3 3 3 3 3 stale", reason="no_metrics"),
        series(decisions, ours, "0 0 0 1 1 1 1 1 1 stale", reason="scale_up"),
        series(decisions, ours, "0 0 0 0 1 2 3 4 5 stale", reason="hold"),
        # Another release's planner in the same namespace, and one of this name elsewhere.
        series(desired, "other-pdserve-planner-1-a", "9x12"),
        series(decisions, "other-pdserve-planner-1-a", "1+1x12", reason="hold"),
        series(desired, ours, "7x12", namespace="staging"),
        series(decisions, ours, "1+1x12", namespace="staging", reason="hold"),
    ]
    expected = [("2m", []), ("3m", [3]), ("7m", [3]), ("10m", [])]
    cases = [
        {
            "expr": query["query"],
            "eval_time": at,
            "exp_samples": [{"labels": "{}", "value": value} for value in values],
        }
        for at, values in expected
    ]
    (tmp_path / "empty.rules.yaml").write_text("groups: []\n")
    test_file = tmp_path / "scaled-object.test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": ["empty.rules.yaml"],
                "evaluation_interval": "1m",
                "tests": [
                    {"interval": "1m", "input_series": input_series, "promql_expr_test": cases}
                ],
            }
        )
    )
    result = subprocess.run(
        [str(find_binary("promtool")), "test", "rules", test_file.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout

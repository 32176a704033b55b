"""The chart renders, lints and validates for the default values and every example, and renders
what the deployment needs (one pod shape for both roles, GPUs, drain, probes, Redis, dashboards)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.deploy.chart import (
    CHART_DIR,
    DASHBOARDS,
    EXAMPLES,
    Manifest,
    container,
    env,
    find,
    kinds,
    load_values,
    notes,
    pod_specs,
    render,
    validate_manifest,
)

VALUE_SETS = [pytest.param(None, id="default"), *(pytest.param(p, id=p.stem) for p in EXAMPLES)]


def values_of(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else load_values(path)


def test_examples_exist_for_the_documented_layouts() -> None:
    assert {p.stem for p in EXAMPLES} >= {
        "pp2-prefill-tp2-decode",
        "external-redis",
        "multi-node-lws",
        "reference-cpu",
        "planner-keda",
    }


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(
    chart: helm.Chart, values_file: Path | None
) -> None:
    manifests = render(chart, values_of(values_file))
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap"} <= kinds(manifests)
    problems = [line for m in manifests for line in validate_manifest(m)]
    assert problems == []


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_helm_lint_finds_nothing_above_info(values_file: Path | None) -> None:
    report = helm.lint(str(CHART_DIR), values_of(values_file), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_validator_catches_an_unknown_field(chart: helm.Chart) -> None:
    """Strict schemas: a misspelt field in a rendered object is reported, not ignored."""
    router = find(render(chart), "Deployment", "-router")
    broken = copy.deepcopy(router.body)
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    problems = validate_manifest(Manifest(router.template, broken))
    assert problems and "livenesProbe" in problems[0]


def test_prefill_and_decode_render_through_one_pod_shape(chart: helm.Chart) -> None:
    """With the same values, the two roles' pods differ only by the role's name."""
    role = load_values(CHART_DIR / "examples" / "pp2-prefill-tp2-decode.yaml")["prefill"]
    role["drain"] = {"preStop": True}  # the one default that differs between the roles
    manifests = render(chart, {"prefill": role, "decode": role})
    prefill = find(manifests, "StatefulSet", "-prefill").body["spec"]["template"]
    decode = find(manifests, "StatefulSet", "-decode").body["spec"]["template"]
    as_decode = json.loads(json.dumps(prefill).replace("prefill", "decode"))
    assert as_decode == decode


def test_gpus_are_pp_times_tp_per_pod_and_split_over_a_leader_worker_group(
    chart: helm.Chart,
) -> None:
    manifests = render(chart, load_values(CHART_DIR / "examples" / "pp2-prefill-tp2-decode.yaml"))
    for suffix in ("-prefill", "-decode"):  # PP=2 x TP=1 and PP=1 x TP=2
        (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", suffix))
        limits = container(pod)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == 2
        assert limits["rdma/rdma_shared_device_a"] == 1
        assert container(pod)["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]

    multi = render(chart, load_values(CHART_DIR / "examples" / "multi-node-lws.yaml"))
    group = find(multi, "LeaderWorkerSet", "-prefill")
    assert group.body["spec"]["leaderWorkerTemplate"]["size"] == 4
    members = dict(pod_specs(group))
    for pod in members.values():  # PP=4 x TP=8 over 4 nodes
        assert container(pod)["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "exec pdserve 'prefill'" in container(members["leader"])["args"][0]
    assert "LWS_LEADER_ADDRESS" in container(members["worker"])["args"][0]
    assert "readinessProbe" not in container(members["worker"])

    cpu = render(chart, load_values(CHART_DIR / "examples" / "reference-cpu.yaml"))
    (_, pod), *_ = pod_specs(find(cpu, "StatefulSet", "-prefill"))
    assert "nvidia.com/gpu" not in container(pod)["resources"].get("limits", {})
    assert "UCX_TLS" not in env(pod)


def test_engine_command_carries_the_layout_and_the_service_flags(chart: helm.Chart) -> None:
    manifests = render(chart, {"prefill": {"pp": 2, "tp": 4, "kvLeaseSeconds": 45}})
    (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", "-prefill"))
    args = container(pod)["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert args[0] == "prefill"
    assert flags["--pp"] == "2" and flags["--tp"] == "4"
    assert flags["--engine"] == "vllm"
    assert flags["--kv-lease-s"] == "45"
    assert flags["--advertise"] == "$(POD_IP):50051"
    assert flags["--engine-id"] == "$(POD_NAME)"
    assert container(pod)["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_prefill_drain_waits_out_kv_leases_within_the_grace_period(chart: helm.Chart) -> None:
    manifests = render(chart, {"prefill": {"kvLeaseSeconds": 40, "drain": {"timeoutSeconds": 50}}})
    (_, prefill), *_ = pod_specs(find(manifests, "StatefulSet", "-prefill"))
    (_, decode), *_ = pod_specs(find(manifests, "StatefulSet", "-decode"))
    assert prefill["spec"]["terminationGracePeriodSeconds"] > 40 + 50
    hook = container(prefill)["lifecycle"]["preStop"]["exec"]["command"]
    assert "kill -TERM 1" in hook[-1] and "-lt 90" in hook[-1]
    assert "lifecycle" not in container(decode)  # decode drains on SIGTERM alone


def test_engines_use_grpc_probes_and_the_router_http_probes(chart: helm.Chart) -> None:
    manifests = render(chart)
    (_, engine), *_ = pod_specs(find(manifests, "StatefulSet", "-decode"))
    assert container(engine)["readinessProbe"]["grpc"] == {"port": 50051}
    assert container(engine)["startupProbe"]["grpc"] == {"port": 50051}
    assert "tcpSocket" in container(engine)["livenessProbe"]
    router = find(manifests, "Deployment", "-router").body["spec"]["template"]
    assert container(router)["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container(router)["livenessProbe"]["httpGet"]["path"] == "/metrics"


def test_shared_memory_is_an_in_memory_volume_at_dev_shm(chart: helm.Chart) -> None:
    manifests = render(chart, {"decode": {"shmSize": "32Gi"}})
    (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", "-decode"))
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(pod)["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_bundled_redis_requires_a_password_every_component_reads(chart: helm.Chart) -> None:
    manifests = render(chart)
    secret = find(manifests, "Secret", "-redis")
    assert set(secret.body["data"]) == {"redis-password"}
    redis = find(manifests, "StatefulSet", "-redis").body["spec"]["template"]
    assert '--requirepass "$REDIS_PASSWORD"' in container(redis)["args"][0]
    (_, engine), *_ = pod_specs(find(manifests, "StatefulSet", "-prefill"))
    router = find(manifests, "Deployment", "-router").body["spec"]["template"]
    for pod in (engine, router):
        variables = env(pod)
        assert variables["PDSERVE_CONTROL_PLANE__REDIS__URL"] == "redis://demo-pdserve-redis:6379/0"
        assert variables["PDSERVE_CONTROL_PLANE__REDIS__PASSWORD"] == {
            "secretKeyRef": {"name": secret.name, "key": "redis-password"}
        }
        assert variables["PDSERVE_CONTROL_PLANE__NAMESPACE"] == "demo"


def test_external_redis_uses_the_existing_secret_and_renders_no_redis(chart: helm.Chart) -> None:
    manifests = render(chart, load_values(CHART_DIR / "examples" / "external-redis.yaml"))
    assert not [m for m in manifests if m.name.endswith("-redis")]
    (_, engine), *_ = pod_specs(find(manifests, "StatefulSet", "-decode"))
    variables = env(engine)
    assert variables["PDSERVE_CONTROL_PLANE__REDIS__URL"].startswith("rediss://")
    assert variables["PDSERVE_CONTROL_PLANE__REDIS__PASSWORD"]["secretKeyRef"]["name"] == (
        "pdserve-redis"
    )
    assert variables["PDSERVE_CONTROL_PLANE__REDIS__TLS_CA_FILE"] == "/etc/pdserve/redis-ca/ca.crt"


def test_an_external_redis_through_sentinel_is_accepted_and_passed_on(chart: helm.Chart) -> None:
    url = "redis+sentinel://sentinel-0:26379,sentinel-1:26379/pdserve"
    values = load_values(CHART_DIR / "examples" / "external-redis.yaml")
    values["redis"]["external"]["url"] = url
    (_, engine), *_ = pod_specs(find(render(chart, values), "StatefulSet", "-decode"))
    assert env(engine)["PDSERVE_CONTROL_PLANE__REDIS__URL"] == url


def test_dashboards_ship_as_configmaps_with_the_sidecar_label(chart: helm.Chart) -> None:
    assert len(DASHBOARDS) >= 2
    default = [m for m in render(chart) if m.kind == "ConfigMap"]
    shipped = {key: value for m in default for key, value in m.body["data"].items()}
    assert shipped == {p.name: p.read_text().rstrip("\n") for p in DASHBOARDS}
    assert all(m.body["metadata"]["labels"]["grafana_dashboard"] == "1" for m in default)

    custom = render(
        chart,
        {
            "dashboards": {
                "label": "grafana.io/dashboard",
                "labelValue": "pdserve",
                "namespace": "monitoring",
            }
        },
    )
    for m in (m for m in custom if m.kind == "ConfigMap"):
        assert m.body["metadata"]["labels"]["grafana.io/dashboard"] == "pdserve"
        assert m.body["metadata"]["namespace"] == "monitoring"
    assert "ConfigMap" not in kinds(render(chart, {"dashboards": {"enabled": False}}))


@pytest.mark.parametrize("monitor", ["podMonitor", "serviceMonitor"])
def test_monitors_are_opt_in_and_valid(chart: helm.Chart, monitor: str) -> None:
    assert not kinds(render(chart)) & {"PodMonitor", "ServiceMonitor"}
    manifests = render(chart, {"metrics": {monitor: {"enabled": True}}})
    kind = monitor[0].upper() + monitor[1:]
    found = find(manifests, kind)
    assert validate_manifest(found) == []
    assert found.body["spec"]["selector"]["matchLabels"]["pdserve.io/serving"] == "true"


def test_router_extras_render_when_enabled(chart: helm.Chart) -> None:
    manifests = render(
        chart,
        {
            "router": {
                "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 6},
                "ingress": {"enabled": True},
                "apiKeys": {"existingSecret": "router-keys", "existingSecretKey": "keys"},
            }
        },
    )
    assert {"HorizontalPodAutoscaler", "Ingress", "PodDisruptionBudget"} <= kinds(manifests)
    router = find(manifests, "Deployment", "-router").body
    assert "replicas" not in router["spec"]  # the HPA owns it
    assert env(router["spec"]["template"])["PDSERVE_ROUTER_API_KEYS"] == {
        "secretKeyRef": {"name": "router-keys", "key": "keys"}
    }


def test_notes_tell_how_to_reach_the_router(chart: helm.Chart) -> None:
    text = notes(chart)
    assert "port-forward service/demo-pdserve-router" in text
    assert "pdserve status" in text


def test_values_schema_is_shipped_not_ignored() -> None:
    patterns = (CHART_DIR / ".helmignore").read_text().splitlines()
    assert not [p for p in patterns if "schema" in p and not p.startswith("#")]
    with helm.Chart.load(CHART_DIR) as loaded:
        assert loaded.schema is not None
        assert loaded.schema["additionalProperties"] is False


def test_router_front_end_reads_the_models_checkpoint_with_its_flags(chart: helm.Chart) -> None:
    """The router's front end (vLLM's) reads ``model.path`` with its vLLM flags, with vLLM and
    with reference engines; the removed ``router.frontend`` value is refused by the schema."""

    def router_args(values: dict[str, Any]) -> list[str]:
        found = find(render(chart, values), "Deployment", "-router")
        return list(container(found.body["spec"]["template"])["args"])

    args = router_args({"router": {"frontendArgs": ["--tool-call-parser=hermes"]}})
    assert "--frontend" not in args
    assert "--frontend-arg=--tool-call-parser=hermes" in args
    cpu = load_values(CHART_DIR / "examples" / "reference-cpu.yaml")
    reference = router_args(cpu)
    assert reference[reference.index("--tokenizer") + 1] == cpu["model"]["path"]
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"router": {"frontend": "pdserve"}})


def test_lora_values_reach_every_engine_and_the_routers_front_end(chart: helm.Chart) -> None:
    """``lora``: the engines start with vLLM's LoRA flags and load the modules, the router's
    front end serves them (``--enable-lora``, ``--lora-modules``) and, with ``runtimeUpdates``,
    vLLM's load and unload endpoints (its environment switch); off by default."""
    lora = {
        "enabled": True,
        "modules": [{"name": "sql", "path": "/models/adapters/sql"}],
        "maxLoras": 4,
        "maxLoraRank": 32,
        "runtimeUpdates": True,
    }
    manifests = render(chart, {"lora": lora})
    for role in ("prefill", "decode"):
        (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", f"-{role}"))
        args = container(pod)["args"]
        assert "--enable-lora" in args
        assert args[args.index("--max-loras") + 1] == "4"
        assert args[args.index("--max-lora-rank") + 1] == "32"
        assert args[args.index("--lora-modules") + 1] == "sql=/models/adapters/sql"
    router = find(manifests, "Deployment", "-router").body["spec"]["template"]
    args = container(router)["args"]
    start = args.index("--frontend-arg=--lora-modules")
    assert args[start - 1] == "--frontend-arg=--enable-lora"
    assert args[start + 1] == "--frontend-arg=sql=/models/adapters/sql"
    assert env(router)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = render(chart)
    (_, pod), *_ = pod_specs(find(plain, "StatefulSet", "-decode"))
    assert "--enable-lora" not in container(pod)["args"]
    router = find(plain, "Deployment", "-router").body["spec"]["template"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env(router)


def test_router_workers_share_the_port_and_each_is_scraped_on_its_own(chart: helm.Chart) -> None:
    single = find(render(chart), "Deployment", "-router").body["spec"]["template"]
    assert "--workers" not in container(single)["args"]
    values: dict[str, Any] = {"router": {"workers": 3, "workerMetricsPort": 9400}}
    manifests = render(chart, values)
    pod = find(manifests, "Deployment", "-router").body["spec"]["template"]
    router = container(pod)
    args = router["args"]
    assert args[args.index("--workers") + 1] == "3"
    assert args[args.index("--worker-metrics-port") + 1] == "9400"
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"http": 8000, "metrics-w0": 9400, "metrics-w1": 9401, "metrics-w2": 9402}
    service = find(manifests, "Service", "-router").body
    assert {p["name"] for p in service["spec"]["ports"]} == set(ports)
    for manifest in manifests:
        assert validate_manifest(manifest) == []
    # Every worker scraped on its own port; not the shared one (it would count one twice).
    for monitor, key in (("podMonitor", "podMetricsEndpoints"), ("serviceMonitor", "endpoints")):
        kind = monitor[0].upper() + monitor[1:]
        found = find(render(chart, {**values, "metrics": {monitor: {"enabled": True}}}), kind)
        assert validate_manifest(found) == []
        scraped = {e["port"] for e in found.body["spec"][key]}
        assert scraped == {"metrics", "metrics-w0", "metrics-w1", "metrics-w2"}


def test_each_entry_of_models_gets_its_own_engines_and_the_router_serves_every_model(
    chart: helm.Chart,
) -> None:
    """``models``: each further base model gets prefill and decode StatefulSets of its own
    (its path, the top-level layout with its overrides, selectors no other model's pods
    match, no LoRA adapters: those are the first model's); the router's front end reads every
    model (``--model``); what cannot work is refused (the planner, two folders of one name, an
    override key the role does not have)."""
    small = {"name": "small", "path": "/models/small", "decode": {"tp": 2}}
    lora = {"enabled": True, "modules": [{"name": "sql", "path": "/models/adapters/sql"}]}
    manifests = render(chart, {"models": [small], "lora": lora})
    selectors = set()
    for role, tp in (("prefill", "1"), ("decode", "2")):
        workload = find(manifests, "StatefulSet", f"-{role}-small")
        selectors.add(json.dumps(workload.body["spec"]["selector"], sort_keys=True))
        selectors.add(
            json.dumps(find(manifests, "StatefulSet", f"-{role}").body["spec"]["selector"])
        )
        (_, pod), *_ = pod_specs(workload)
        args = container(pod)["args"]
        assert args[args.index("--model") + 1] == "/models/small"
        assert args[args.index("--tp") + 1] == tp
        assert "--enable-lora" not in args
        assert pod["metadata"]["labels"]["pdserve.io/model"] == "small"
    assert len(selectors) == 4
    router = find(manifests, "Deployment", "-router").body["spec"]["template"]
    args = container(router)["args"]
    assert args[args.index("--model") + 1] == "/models/small"
    assert args[args.index("--tokenizer") + 1] == "/models/model"
    refused = [
        ({"planner": {"enabled": True}}, "the planner sizes one model's pools"),
        ({"models": [{**small, "path": "/other/model"}]}, "another model's folder"),
        ({"models": [{**small, "decode": {"tpp": 2}}]}, "decode.tpp is not a key of decode"),
    ]
    for values, message in refused:
        with pytest.raises(helm.HelmRenderError, match=message):
            render(chart, {"models": [small], **values})

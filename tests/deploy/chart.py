"""Rendering the chart with the real Helm engine and validating what it renders, offline.

Helm comes from the ``helm-python-sdk`` wheel (Helm's Go SDK behind a C ABI; no helm binary, no
cluster). Built-in kinds are validated with ``kubernetes-validate`` (it ships the Kubernetes
OpenAPI schemas, strict mode: unknown fields fail). Custom resources (LeaderWorkerSet,
PodMonitor, ServiceMonitor, KEDA's ScaledObject) are validated against the structural subsets in
``crd_schemas/``,
and a LeaderWorkerSet's pod templates against the Kubernetes PodTemplateSpec schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "pdserve"
EXAMPLES = sorted((CHART_DIR / "examples").glob("*.yaml"))
DASHBOARDS = sorted((CHART_DIR / "dashboards").glob("*.json"))
CRD_SCHEMAS = Path(__file__).parent / "crd_schemas"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
RELEASE = "demo"
NAMESPACE = "llm"


@dataclass(frozen=True)
class Manifest:
    """One rendered Kubernetes object and the template that produced it."""

    template: str
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def __repr__(self) -> str:
        return f"{self.kind}/{self.name} ({self.template})"


def load_values(path: Path) -> dict[str, Any]:
    values = yaml.safe_load(path.read_text())
    assert isinstance(values, dict), f"{path} is not a mapping"
    return values


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every object the chart renders for ``values`` (NOTES.txt left out)."""
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    manifests: list[Manifest] = []
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            continue
        for body in yaml.safe_load_all(text):
            if body:
                manifests.append(Manifest(template, body))
    return manifests


def notes(chart: helm.Chart, values: dict[str, Any] | None = None) -> str:
    rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for template, text in rendered.items() if template.endswith("NOTES.txt"))


def find(manifests: list[Manifest], kind: str, name_suffix: str = "") -> Manifest:
    """The one object of ``kind`` whose name ends with ``name_suffix``."""
    matches = [m for m in manifests if m.kind == kind and m.name.endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {matches}"
    return matches[0]


def kinds(manifests: list[Manifest]) -> set[str]:
    return {m.kind for m in manifests}


def validate_manifest(manifest: Manifest) -> list[str]:
    """Schema problems of one object, as readable lines (empty when valid)."""
    schema_file = _crd_schema_file(manifest.body)
    if schema_file is not None:
        return _validate_custom_resource(manifest, schema_file)
    problems: list[str] = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(manifest.body, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            problems.append(f"{manifest!r} @ k8s {version}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(
                f"{manifest!r}: no Kubernetes {version} schema for {manifest.body['apiVersion']} "
                f"{manifest.kind}, and no bundled CRD schema in {CRD_SCHEMAS.name}/"
            )
    return problems


def _crd_schema_file(body: dict[str, Any]) -> Path | None:
    group_version = str(body["apiVersion"]).replace("/", "-")
    candidate = CRD_SCHEMAS / f"{str(body['kind']).lower()}-{group_version}.json"
    return candidate if candidate.exists() else None


def _validate_custom_resource(manifest: Manifest, schema_file: Path) -> list[str]:
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    problems = [
        f"{manifest!r} @ {schema_file.name}: {'/'.join(map(str, e.path))}: {e.message}"
        for e in validator.iter_errors(manifest.body)
    ]
    if manifest.kind == "LeaderWorkerSet" and not problems:
        group = manifest.body["spec"]["leaderWorkerTemplate"]
        for member in ("leaderTemplate", "workerTemplate"):
            if member in group:
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{manifest.name}-{member}"},
                    "template": group[member],
                }
                problems += validate_manifest(Manifest(f"{manifest.template}#{member}", wrapped))
    return problems


def pod_specs(manifest: Manifest) -> Iterator[tuple[str, dict[str, Any]]]:
    """(member, pod template) of a workload: "single" for StatefulSet/Deployment pods,
    "leader"/"worker" for a LeaderWorkerSet group."""
    spec = manifest.body["spec"]
    if manifest.kind == "LeaderWorkerSet":
        group = spec["leaderWorkerTemplate"]
        yield "leader", group["leaderTemplate"]
        yield "worker", group["workerTemplate"]
    else:
        yield "single", spec["template"]


def container(pod_template: dict[str, Any]) -> dict[str, Any]:
    containers = pod_template["spec"]["containers"]
    assert len(containers) == 1, containers
    return dict(containers[0])


def env(pod_template: dict[str, Any]) -> dict[str, Any]:
    """name -> value (or valueFrom) of the container's environment."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(pod_template)["env"]}

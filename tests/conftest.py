"""Shared fixtures: a real redis-server per test session, a fresh namespace per test, and
throw-away certificates (openssl) for the TLS tests."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.engines.registry import SyntheticModel, synthetic_model
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint
from tests.security.pki import make_pki

pytest_plugins = ["tests.timing"]

# Hypothesis judges wall-clock time by default (a 200 ms deadline per example, the too_slow
# health check on data generation); a loaded 2-core CI machine breaks both without any bug.
# Every property test runs under this profile; a test's own @settings still override it.
settings.register_profile(
    "pdserve", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("pdserve")


def pytest_configure(config: pytest.Config) -> None:
    """Torch's work in a test process stays on one thread, so no OpenMP pool ever exists here
    and the engines a test builds in-process may fork their processes as engine hosts do
    (tests/forked_engines.py): a process forked after its parent ran a parallel torch op can
    hang in its first one (libgomp is not fork-safe). Two test workers share two cores, so one
    thread each is also what the machine has. Bytecode is cached: see
    :func:`_cache_bytecode`."""
    _cache_bytecode()
    import torch  # noqa: PLC0415 - configured before any test imports it

    torch.set_num_threads(1)


def _cache_bytecode() -> None:
    """Python writes its bytecode caches (``__pycache__``) in the test run even where the
    environment says not to (``PYTHONDONTWRITEBYTECODE``, set on the CI machine): the suite
    starts hundreds of Python processes (``pdserve up``, routers, engine hosts, the CLI), each
    importing the project, and without caches each one compiled every module it imported again,
    as did each pytest worker for every test module (assertion rewriting). Cleared here, before
    any worker or child starts, so they all inherit it; the caches are checked against their
    sources, so an edited module is compiled again."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How ``make test`` shares the machine between its pytest workers (pytest-xdist,
    ``--dist loadgroup``): every module is one unit of work, so a module-scoped stack starts once
    (a module that shares a session stack with others names that group with its own
    ``xdist_group`` mark), and units run heaviest kind first, so the longest units do not start
    last: those that start vLLM engines (``vllm`` mark), then the other slow ones, then the rest;
    the order inside a kind is the files', a group's modules together where its first one is.
    Serially (plain ``pytest``) only the module order changes."""
    group_kind: dict[str, int] = {}
    group_first: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
        group = xdist_group_of(item)
        kind = 0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow") else 2
        group_kind[group] = min(kind, group_kind.get(group, kind))
        group_first.setdefault(group, index)
    # Stable, and by group: a module's (a group's) items stay together, so its fixtures start
    # once and a shared stack stops after its group's last item (tests/e2e/conftest.py).
    items.sort(
        key=lambda item: (group_kind[xdist_group_of(item)], group_first[xdist_group_of(item)])
    )
    _select_for_this_machine(config, items)


def xdist_group_of(item: pytest.Item) -> str:
    """The item's unit of work (its ``xdist_group``: its module's path unless it names one)."""
    marker = item.get_closest_marker("xdist_group")
    assert marker is not None, f"{item.nodeid} has no xdist_group (collection adds one)"
    # Read as pytest-xdist reads it (``xdist.remote``): the first argument, else ``name``.
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


def _select_for_this_machine(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests run only with PDSERVE_GPU_TESTS=1 (``make gpu-test`` on a GPU machine). Image
    tests (build the container image, minutes) are deselected unless PDSERVE_IMAGE_TESTS=1
    (``make image-test``); the end-to-end run of ``pdserve bench peers`` (two vLLM stacks)
    unless PDSERVE_PEERS_TESTS=1."""
    for marker, env in (("image", "PDSERVE_IMAGE_TESTS"), ("peers", "PDSERVE_PEERS_TESTS")):
        if os.environ.get(env) == "1":
            continue
        deselected = [item for item in items if item.get_closest_marker(marker)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]
    if os.environ.get("PDSERVE_GPU_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="needs a GPU: run `make gpu-test` with PDSERVE_GPU_TESTS=1")
    for item in items:
        # The marker, not the keyword: a parameter id "gpu" is a keyword too.
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedisServer]:
    """A real redis-server on a free port for the whole session."""
    with LocalRedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CA, server (127.0.0.1) and client certificates; see :func:`make_pki`."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unrelated CA and certificates: trusted by nobody else in the tests."""
    return make_pki(tmp_path_factory.mktemp("other-pki"))


def _write_checkpoint(directory: Path, model: SyntheticModel) -> Path:
    """The synthetic checkpoint the router's front end reads for ``model`` (a stub or sim
    engine's: its vocabulary and context), written into ``directory/<model name>``."""
    return write_synthetic_checkpoint(
        directory / model.name, vocab_size=model.vocab_size, max_model_len=model.max_model_len
    )


@pytest.fixture(scope="session")
def stub_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic checkpoint of the stub engine's model (``stub``: 32,000 ids, 4,096 tokens
    of context): the router's ``tokenizer`` for stub engines, with
    ``served_model_name="stub"``."""
    return _write_checkpoint(tmp_path_factory.mktemp("stub-checkpoint"), synthetic_model("stub"))


@pytest.fixture(scope="session")
def sim_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic checkpoint of the default sim profile's model (``sim-<profile>``): the
    router's ``tokenizer`` for sim engines, with ``served_model_name`` the profile's
    ``served_model``."""
    return _write_checkpoint(tmp_path_factory.mktemp("sim-checkpoint"), synthetic_model("sim"))


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def cp_settings(redis_server: LocalRedisServer, namespace: str) -> ControlPlaneSettings:
    """Short leases so expiry tests stay fast; a namespace of its own per test."""
    return ControlPlaneSettings(
        redis=RedisSettings(url=redis_server.url, retry_attempts=3, retry_backoff_s=0.02),
        namespace=namespace,
        lease_ttl_s=5.0,
        heartbeat_interval_s=1.0,
        resync_interval_s=0.3,
    )


@pytest.fixture
def metrics() -> ControlPlaneMetrics:
    return ControlPlaneMetrics(CollectorRegistry())


@pytest.fixture
async def control_plane(
    cp_settings: ControlPlaneSettings, metrics: ControlPlaneMetrics
) -> AsyncIterator[RedisControlPlane]:
    cp = RedisControlPlane(cp_settings, metrics)
    yield cp
    await cp.close()


def counter_value(metrics: ControlPlaneMetrics, name: str, **labels: str) -> float:
    """The current value of one labelled sample (0 when it was never set)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value

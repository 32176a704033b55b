"""Reference-engine stacks shared by end-to-end modules (issue 34): each starts once per pytest
process, on first use, and stops after the last item of the modules that share it
(:func:`stop_after_group`), not at the process's end: idle, the PD stack would cost about a
tenth of a core for the rest of the run (15 processes, each rank polling its NIXL agent).

A module that uses one marks itself with the stack's ``pytest.mark.xdist_group``, so ``make
test``'s workers run every such module in the same process (one start), one after the other
(``tests/conftest.py`` keeps a group's items together, serially too). The modules that only
read share :data:`SHARED_REFERENCE`'s stacks; a module that kills, stops or faults processes
(``destructive``) starts a stack of its own, except the failover and restart scenarios, which
restore the whole stack before each one (:data:`FAULT_STACK`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from services.control_plane.local_redis import free_port
from services.engines.reference.tiny_lora import make_tiny_lora
from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from services.supervision import DetachedProcess
from tests.conftest import xdist_group_of
from tests.e2e.up_system import UpSystem
from tests.timing import shared_stacks_stop_here

if TYPE_CHECKING:
    from tests.e2e.test_failover_reference import Stack

SHARED_REFERENCE = "shared-reference-stacks"
"""The ``xdist_group`` of the modules that use these stacks."""
FAULT_STACK = "reference-fault-stack"
"""The ``xdist_group`` of ``test_failover_reference`` and ``test_restart_reference``, which
share :func:`shared_stack` (destructive, but each scenario starts from the whole stack)."""
VLLM_SERVER = "vllm-server"
"""The ``xdist_group`` of ``test_vllm_frontend_parity`` and ``test_vllm_pd``, which share
:func:`vllm_server`."""
MODEL = "tiny-model"
OTHER_MODEL = "tiny-qwen"
"""The shared PD stack's second base model (:func:`other_model_dir`)."""
OTHER_MODEL_SPEC = TinyModelSpec(
    model_type="qwen2",
    num_layers=3,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=64,
    max_position_embeddings=256,
)
"""Another shape (and architecture) than the tiny checkpoint's: its KV does not fit the tiny
model's engines (another compatibility hash), and its context is shorter."""


_stops: dict[str, list[Callable[[], None]]] = defaultdict(list)
"""Per ``xdist_group``: how to stop the stacks started for it in this process."""
_ended: set[str] = set()
"""The groups whose last item ran (and whose stacks stopped)."""


def stop_after_group(group: str, stop: Callable[[], None]) -> None:
    """Call ``stop`` after the last item of ``group`` (its items run one after the other:
    ``tests/conftest.py``), not when this process ends. ``stop`` must be idempotent: the
    fixture's own tear-down calls it again at the end."""
    _stops[group].append(stop)


def started(work_dir: Path, model_dir: Path, *args: str, env: dict[str, str]) -> Iterator[UpSystem]:
    """``pdserve up`` of ``model_dir`` with ``args``, READY; stopped cleanly (exit status 0)
    after the last item of :data:`SHARED_REFERENCE`."""
    up = UpSystem(work_dir, "--model", str(model_dir), *args, env=env, scrub_env=True)

    def stop() -> None:
        assert up.stop() == 0, up.output()

    stop_after_group(SHARED_REFERENCE, stop)
    try:
        yield up.wait_ready()
    finally:
        stop()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A group's stacks are not asked for after the group ended (see
    :func:`stop_after_group`); fails loudly rather than hand out a stopped stack."""
    if xdist_group_of(item) in _ended:
        pytest.fail(
            f"{item.nodeid}: its group's stacks stopped after the group's last item (a group's "
            "items run one after the other serially and with --dist loadgroup, as make test "
            "runs; not with another --dist)"
        )


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last item of a group that started stacks here, stop them."""
    group = xdist_group_of(item)
    if group not in _stops or (nextitem is not None and xdist_group_of(nextitem) == group):
        return
    _ended.add(group)
    shared_stacks_stop_here()
    for stop in _stops.pop(group):
        stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint (seed 0) every shared stack serves."""
    return make_tiny_model(tmp_path_factory.mktemp("shared-model") / MODEL)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared PD stack's second base model (seed 1, :data:`OTHER_MODEL_SPEC`)."""
    directory = tmp_path_factory.mktemp("shared-other-model") / OTHER_MODEL
    return make_tiny_model(directory, seed=1, spec=OTHER_MODEL_SPEC)


@pytest.fixture(scope="session")
def reference_pd(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, other_model_dir: Path
) -> Iterator[UpSystem]:
    """Two base models behind the one router. The tiny checkpoint: two prefill engines (PP=2
    each: a pipeline's hand-off on every request, ``prefill-0``, ``prefill-1``) and one
    decode engine (PP=1, TP=1, ``decode-0``); :data:`OTHER_MODEL`: one prefill and one decode
    engine (``prefill-2``, ``decode-1``). Prefix-aware routing, every request disaggregated (a
    prompt the decode engine holds is not run there alone). vLLM's front end (the default
    with a checkpoint) with usage's cached tokens, the hermes tool parser and request chat
    templates trusted."""
    yield from started(
        tmp_path_factory.mktemp("shared-reference-pd"),
        tiny_model_dir,
        "--model",
        f"{other_model_dir},prefill-replicas=1,prefill-pp=1",
        "--prefill-replicas",
        "2",
        "--prefill-pp",
        "2",
        "--frontend-arg=--enable-prompt-tokens-details",  # usage's cached tokens, as vLLM's
        "--frontend-arg=--tool-call-parser=hermes",
        "--frontend-arg=--enable-auto-tool-choice",
        "--frontend-arg=--trust-request-chat-template",
        env={"PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2", "PDSERVE_ROUTER_POLICY": "prefix_aware"},
    )


@pytest.fixture(scope="session")
def reference_colocated(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[UpSystem]:
    """One decode engine serving whole requests (``--colocated``): what PD must equal."""
    yield from started(
        tmp_path_factory.mktemp("shared-reference-colocated"), tiny_model_dir, "--colocated", env={}
    )


@pytest.fixture(scope="session")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The failover and restart scenarios' stack (:data:`FAULT_STACK`): two prefill and two
    decode engines of the tiny checkpoint, a killed one restarted half a second later, with the
    fault-free run's texts. Each scenario waits for it whole first
    (``test_failover_reference.stack``), so they pass in any order; stopped after the group's
    last item."""
    from tests.e2e.test_failover_reference import started_stack  # noqa: PLC0415 - its helpers

    stacks = started_stack(
        tmp_path_factory, "up-failover", "--prefill-replicas", "2", "--decode-replicas", "2",
        "--restart-backoff-s", "0.5",
    )  # fmt: skip
    stack = next(stacks)

    def stop() -> None:
        stack.up.stop()

    stop_after_group(FAULT_STACK, stop)
    try:
        yield stack
    finally:
        stacks.close()  # stops it, if the group's end has not


VLLM_SERVER_FLAGS = (
    "--tool-call-parser=hermes",
    "--enable-auto-tool-choice",
    "--trust-request-chat-template",
    "--max-model-len=512",
)
"""The front-end flags of :func:`vllm_server`, which ``test_vllm_frontend_parity``'s pdserve
stack is given too."""
VLLM_SERVER_ADAPTER = "sql"
"""The adapter :func:`vllm_server` serves from its start (``--lora-modules``)."""
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
"""Adapters loaded and unloaded at run time (vLLM's server and pdserve's router alike)."""
VLLM_SERVER_START_S = 900.0


class VllmServer:
    """vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``) of the tiny
    checkpoint, started by :func:`vllm_server`; :meth:`url` waits until it answers."""

    def __init__(self, model_dir: Path, adapter_dir: Path, log: Path) -> None:
        self.model_dir = model_dir
        self.adapter_dir = adapter_dir
        self.log = log
        self.port = free_port()
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--dtype", "float32", "--enforce-eager", "--port", str(self.port),
            "--host", "127.0.0.1", "--block-size", "32", "--served-model-name", MODEL,
            *VLLM_SERVER_FLAGS,
            "--enable-lora", "--lora-modules", f"{VLLM_SERVER_ADAPTER}={adapter_dir}",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **LORA_ENV}
        # Its own process group, ended with this process: a stop past its bound kills the
        # server's engine core too.
        self.process = DetachedProcess(argv, log, env)
        self._healthy = False

    def url(self) -> str:
        """Its base URL, once ``/health`` answers 200 (fails with its log if it exits first or
        takes longer than :data:`VLLM_SERVER_START_S`)."""
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + VLLM_SERVER_START_S
        while not self._healthy:
            assert self.process.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, self.log.read_text()[-4000:]
            with contextlib.suppress(httpx.HTTPError):  # not listening yet
                self._healthy = httpx.get(f"{url}/health", timeout=5).status_code == 200
            if not self._healthy:
                time.sleep(0.5)
        return url

    def stop(self) -> None:
        self.process.stop(timeout_s=60)


@pytest.fixture(scope="session")
def vllm_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[VllmServer]:
    """vLLM's own server of :func:`tiny_model_dir` (:data:`VLLM_SERVER_FLAGS`, the random
    adapter :data:`VLLM_SERVER_ADAPTER` from the start, adapters loaded at run time), started
    (not waited for: :meth:`VllmServer.url` waits) on first use and stopped after the last item
    of :data:`VLLM_SERVER`: ``test_vllm_frontend_parity`` compares pdserve with it, and
    ``test_vllm_pd`` takes its colocated reference from it (greedy, penalized and seeded
    outputs equal to a colocated ``pdserve up --engine vllm``'s, 21 of 21, measured on
    2026-11-28), instead of starting a colocated stack of its own."""
    root = tmp_path_factory.mktemp("vllm-server")
    adapter = make_tiny_lora(root / VLLM_SERVER_ADAPTER, tiny_model_dir, seed=1)
    server = VllmServer(tiny_model_dir, adapter, root / "server.log")
    stop_after_group(VLLM_SERVER, server.stop)
    try:
        yield server
    finally:
        server.stop()

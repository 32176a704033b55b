"""Reference-engine stacks shared by the end-to-end modules that only read from them (issue 34):
each starts once per pytest process, on first use, and stops after the last item of those
modules (:func:`pytest_runtest_teardown`), not at the process's end: idle, they would cost about
a tenth of a core for the rest of the run (15 processes, each rank polling its NIXL agent).

A module that uses one marks itself ``pytest.mark.xdist_group(SHARED_REFERENCE)``, so ``make
test``'s workers run every such module in the same process (one start), one after the other
(``tests/conftest.py`` keeps a group's items together, serially too). A module that kills,
stops or faults processes (``destructive``) starts a stack of its own instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from tests.conftest import xdist_group_of
from tests.e2e.up_system import UpSystem
from tests.timing import shared_stacks_stop_here

SHARED_REFERENCE = "shared-reference-stacks"
"""The ``xdist_group`` of the modules that use these stacks."""
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


_shared: list[UpSystem] = []
"""The shared stacks this process started."""
_group_ended = [False]
"""Whether :data:`SHARED_REFERENCE`'s last item ran (and the shared stacks stopped)."""


def started(work_dir: Path, model_dir: Path, *args: str, env: dict[str, str]) -> Iterator[UpSystem]:
    """``pdserve up`` of ``model_dir`` with ``args``, READY; stopped cleanly (exit status 0)
    after the group's last item, or at the process's end (``stop`` is idempotent)."""
    up = UpSystem(work_dir, "--model", str(model_dir), *args, env=env, scrub_env=True)
    _shared.append(up)
    try:
        yield up.wait_ready()
    finally:
        assert up.stop() == 0, up.output()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A shared stack is not asked for after its group ended (the items of a group run one
    after the other: see the module docstring); fails loudly rather than hand out a stopped
    stack."""
    if _group_ended[0] and xdist_group_of(item) == SHARED_REFERENCE:
        pytest.fail(f"{item.nodeid}: the shared stacks stopped after their group's last item")


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last item of :data:`SHARED_REFERENCE`, stop the shared stacks."""
    if xdist_group_of(item) != SHARED_REFERENCE:
        return
    if nextitem is not None and xdist_group_of(nextitem) == SHARED_REFERENCE:
        return
    _group_ended[0] = True
    shared_stacks_stop_here()
    for up in _shared:
        assert up.stop() == 0, up.output()


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

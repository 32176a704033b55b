"""The version guard lists every private vLLM member pdserve touches, and fails at start-up naming
one the installed vLLM lacks: a class member removed, an instance attribute renamed in vLLM's
source. A scan of pdserve's modules that import vLLM keeps the list complete."""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engines.vllm import version_guard
from services.engines.vllm.version_guard import (
    ENGINE_INSTANCE_ATTRIBUTES,
    ENGINE_SYMBOLS,
    FRONTEND_INSTANCE_ATTRIBUTES,
    FRONTEND_SYMBOLS,
    VllmVersionMismatch,
    check_vllm,
    missing_instance_attributes,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

SERVICES = Path(__file__).resolve().parents[3] / "services"
NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
ALL = (
    *FRONTEND_SYMBOLS,
    *ENGINE_SYMBOLS,
    *FRONTEND_INSTANCE_ATTRIBUTES,
    *ENGINE_INSTANCE_ATTRIBUTES,
)
GUARDED = {path.rpartition(".")[2] for _module, path in ALL}
"""Every member name the guard lists (the last part of each path)."""


def test_the_pinned_vllm_has_every_member_pdserve_touches() -> None:
    check_vllm(ENGINE_SYMBOLS, ENGINE_INSTANCE_ATTRIBUTES)
    check_vllm(FRONTEND_SYMBOLS, FRONTEND_INSTANCE_ATTRIBUTES)
    # the background members of the issue, by name
    for name in ("_nixl_handshake", "_handle_failed_transfer", "_background_nixl_handshake",
                 "_add_notif_only_remote_agent", "_recving_transfers"):  # fmt: skip
        assert name in GUARDED


def test_a_removed_method_fails_at_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: PLC0415

    monkeypatch.delattr(base_worker.NixlBaseConnectorWorker, "_add_notif_only_remote_agent")
    with pytest.raises(VllmVersionMismatch) as raised:
        check_vllm(ENGINE_SYMBOLS, ENGINE_INSTANCE_ATTRIBUTES)
    message = str(raised.value)
    assert f"{NIXL}:NixlPushConnectorWorker._add_notif_only_remote_agent" in message
    assert f"{NIXL}:NixlPullConnectorWorker._add_notif_only_remote_agent" in message
    assert "_nixl_handshake" not in message  # only what is gone


RENAMED_WORKER = '''
class NixlPullConnectorWorker:
    """vLLM's pull worker with one instance attribute renamed."""

    def __init__(self) -> None:
        self._recving_xfers: dict[str, list[int]] = {}
        self._invalid_remote_engines: set[str] = set()
        self._engine_last_active, self._recv_failures = {}, set()

    def later(self) -> None:
        self._remote_agents: dict[str, str] = {}
        self._reqs_to_send = self._reqs_to_process = self._is_csa_linear = None
'''


@pytest.fixture
def renamed_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's ``NixlPullConnectorWorker`` replaced by a class, real source on disk, that
    assigns ``self._recving_xfers`` where vLLM 0.32.0 assigns ``self._recving_transfers``."""
    (tmp_path / "renamed_vllm_worker.py").write_text(RENAMED_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    renamed = importlib.import_module("renamed_vllm_worker")
    nixl = importlib.import_module(NIXL)
    monkeypatch.setattr(nixl, "NixlPullConnectorWorker", renamed.NixlPullConnectorWorker)
    yield
    sys.modules.pop("renamed_vllm_worker", None)


@pytest.mark.usefixtures("renamed_worker")
def test_a_renamed_instance_attribute_fails_at_start_naming_it() -> None:
    pull = [
        (m, p) for m, p in ENGINE_INSTANCE_ATTRIBUTES if p.startswith("NixlPullConnectorWorker")
    ]
    assert missing_instance_attributes(pull) == [
        f"{NIXL}:NixlPullConnectorWorker._recving_transfers"
    ]
    with pytest.raises(VllmVersionMismatch, match=r"NixlPullConnectorWorker\._recving_transfers"):
        check_vllm(ENGINE_SYMBOLS, ENGINE_INSTANCE_ATTRIBUTES)


def test_an_attribute_only_read_in_vllms_source_is_not_taken_as_assigned() -> None:
    # vLLM's pull worker reads self.vllm_config and never assigns it (its base does): the
    # base's source counts, a mere read in the class does not
    assert missing_instance_attributes([(NIXL, "NixlPullConnectorWorker.vllm_config")]) == []
    assert version_guard._assigned_on_self(object) == frozenset()
    pull = importlib.import_module(NIXL).NixlPullConnectorWorker
    assert "vllm_config" not in (version_guard._assigned_on_self(pull) or ())


def test_an_install_without_source_is_reported_unchecked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM installed without its ``.py`` files cannot be checked this way: the start-up
    error says so instead of claiming the attribute is gone."""
    (tmp_path / "sourceless_vllm_worker.py").write_text(RENAMED_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("sourceless_vllm_worker")
    (tmp_path / "sourceless_vllm_worker.py").unlink()
    monkeypatch.setitem(sys.modules, "sourceless_vllm_worker", module)
    linecache.clearcache()
    entry = ("sourceless_vllm_worker", "NixlPullConnectorWorker._recving_transfers")
    assert missing_instance_attributes([entry]) == [
        "sourceless_vllm_worker:NixlPullConnectorWorker._recving_transfers "
        "(no source to check it in)"
    ]


# -- the scan --------------------------------------------------------------------------------


def _imports_vllm(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            return True
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
            return True
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("vllm.")
            and " " not in node.value
        ):
            return True  # importlib.import_module("vllm.sampling_params")
    return False


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class Scan:
    """Private names in pdserve's modules that import vLLM: those read or called as attributes
    (``used``), and those pdserve's classes define (``defined``, per ``(module, class)``)."""

    def __init__(self) -> None:
        self.modules: list[str] = []
        self.used: dict[str, str] = {}
        self.defined: dict[tuple[str, str], set[str]] = {}
        for path in sorted(SERVICES.rglob("*.py")):
            if "proto_gen" in path.parts or path.name == "version_guard.py":
                continue
            tree = ast.parse(path.read_text())
            if not _imports_vllm(tree):
                continue
            module = ".".join(path.relative_to(SERVICES.parent).with_suffix("").parts)
            self.modules.append(module)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and _private(node.attr):
                    self.used.setdefault(node.attr, f"{module}:{node.lineno}")
            for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
                names = self.defined.setdefault((module, cls.name), set())
                for node in ast.walk(cls):
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(node.name)
                    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                        names.add(node.attr)
                    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                        names.add(node.id)
                names.intersection_update(n for n in set(names) if _private(n))

    def pdserve_names(self) -> set[str]:
        return set().union(*self.defined.values())


@pytest.fixture(scope="module")
def scan() -> Scan:
    return Scan()


def test_the_scan_sees_the_modules_that_reach_into_vllm(scan: Scan) -> None:
    for module in ("_connector_worker", "_planned_pull", "_connector_scheduler", "backend"):
        assert f"services.engines.vllm.{module}" in scan.modules
    assert "services.router.frontend.vllm.config" in scan.modules
    assert scan.used["_recving_transfers"].startswith("services.engines.vllm._planned_pull:")


def test_every_private_vllm_member_pdserve_reads_is_in_the_guard(scan: Scan) -> None:
    """A private name pdserve reads that none of its own classes defines is vLLM's (or
    argparse's, through vLLM's parser): the guard must list it."""
    ours = scan.pdserve_names()
    unlisted = {name: where for name, where in scan.used.items() if name not in ours | GUARDED}
    assert unlisted == {}, "list these in services/engines/vllm/version_guard.py"


def _vllm_names(cls: type) -> set[str]:
    """What vLLM's classes in ``cls``'s MRO define: class members and ``self.<name>``."""
    names: set[str] = set()
    for base in inspect.getmro(cls):
        if base.__module__.split(".")[0] == "vllm":
            names |= set(vars(base)) | version_guard._assigned_on_self(base)
    return names


def test_every_private_name_pdserve_shares_with_vllm_is_in_the_guard(scan: Scan) -> None:
    """A private name pdserve defines in a class over vLLM's that vLLM's class defines too is
    an override (or a clash): the guard must list it. Classes nested in functions are skipped
    (they cannot be imported by name)."""
    checked, clashes = 0, {}
    for module, class_name in scan.defined:
        cls = getattr(importlib.import_module(module), class_name, None)
        if not isinstance(cls, type):
            continue
        vllm = _vllm_names(cls)
        if not vllm:
            continue
        checked += 1
        ours = set().union(
            *(scan.defined.get((b.__module__, b.__name__), set()) for b in inspect.getmro(cls))
        )
        for name in (ours & vllm) - GUARDED:
            clashes[name] = f"{module}.{class_name}"
    assert checked >= 6  # the connector, its four sides, the stats, the engine client...
    assert clashes == {}, "list these overrides in services/engines/vllm/version_guard.py"


def test_every_private_member_the_guard_lists_is_still_touched(scan: Scan) -> None:
    touched = set(scan.used) | scan.pdserve_names()
    stale = {name for name in GUARDED if _private(name) and name not in touched}
    assert stale == set()

"""The layer rule of ``services/`` (docs/architecture.md, "Layers"): a package imports only from
the layers below it, never from its own layer's other packages nor from a layer above.

The import graph is read with :mod:`ast` from the source (every ``import``, lazy and
``TYPE_CHECKING`` ones included), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"proto_gen", "config", "topology", "lifetime", "codec", "metrics"}),
    frozenset({"control_plane"}),
    frozenset({"kv_transfer", "kv_events"}),
    frozenset({"tokenization"}),
    frozenset({"engines"}),
    frozenset({"serving"}),
    frozenset({"supervision"}),
    frozenset({"router", "prefill", "decode", "bench", "observability", "devtools", "planner"}),
    frozenset({"cli"}),
)
"""Bottom to top; the same order as docs/architecture.md."""

LAYER_OF = {package: index for index, layer in enumerate(LAYERS) for package in layer}


def _packages() -> set[str]:
    return {p.name for p in SERVICES.iterdir() if (p / "__init__.py").is_file()}


def _imported_packages(source: str, parts: tuple[str, ...]) -> set[tuple[str, int]]:
    """``(package under services, line)`` of every import in the module ``parts``
    (``("services", "serving", "host")``) whose text is ``source``; relative ones resolved."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # The package of a module is its parts minus the file; __init__ is the package.
                base = parts[: len(parts) - node.level]
                modules = (
                    [".".join((*base, node.module))]
                    if node.module
                    else [".".join((*base, alias.name)) for alias in node.names]
                )
            elif node.module:
                modules = [node.module]
        for module in modules:
            names = module.split(".")
            if len(names) >= 2 and names[0] == "services":
                found.add((names[1], node.lineno))
    return found


def _violations(relative: Path, source: str) -> list[str]:
    """The imports of ``services/<relative>`` that break the rule."""
    package = relative.parts[0]
    parts = ("services", *relative.with_suffix("").parts)
    violations = []
    for imported, line in sorted(_imported_packages(source, parts)):
        if imported == package:
            continue
        if imported not in LAYER_OF or LAYER_OF[imported] >= LAYER_OF[package]:
            violations.append(
                f"services/{relative}:{line}: {package} (layer {LAYER_OF.get(package)}) imports "
                f"{imported} (layer {LAYER_OF.get(imported, 'unknown')})"
            )
    return violations


def layer_violations() -> list[str]:
    violations = []
    for path in sorted(SERVICES.rglob("*.py")):
        relative = path.relative_to(SERVICES)
        if len(relative.parts) < 2:
            continue  # services/__init__.py
        violations += _violations(relative, path.read_text(encoding="utf-8"))
    return violations


def test_every_package_has_a_layer() -> None:
    assert _packages() == set(LAYER_OF), "add the new package to LAYERS and docs/architecture.md"


def test_no_package_imports_from_its_layer_or_above() -> None:
    assert layer_violations() == []


def test_the_check_finds_upward_and_sideways_imports() -> None:
    """A check that finds nothing would pass vacuously: probe modules that break the rule."""
    source = (
        "import services.cli.main\n"
        "from services.engines import backend\n"
        "from ..router import api\n"
        "from . import convert\n"
        "def lazy() -> None:\n"
        "    from services.decode import servicer\n"
    )
    found = _violations(Path("serving/probe.py"), source)
    assert [v.split(": ", 1)[1] for v in found] == [
        "serving (layer 5) imports cli (layer 8)",
        "serving (layer 5) imports decode (layer 7)",
        "serving (layer 5) imports router (layer 7)",
    ]
    assert _violations(Path("router/probe.py"), "from services.prefill import service\n")
    assert _violations(Path("serving/probe.py"), "from .. import cli\n")
    assert (
        _violations(Path("serving/host/engine_host.py"), "from services.engines import backend\n")
        == []
    )


def test_architecture_doc_lists_the_same_layers() -> None:
    doc = (SERVICES.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rule = doc.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    for index, layer in enumerate(LAYERS):
        line = next(x for x in rule.splitlines() if x.strip().startswith(f"{index}."))
        assert {name.strip("` ,") for name in line.split(".", 1)[1].split()} >= layer, line


ROUTER_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"config", "errors", "metrics"}),
    frozenset({"scheduling"}),
    frozenset({"execution"}),
    frozenset({"runtime"}),
    frozenset({"frontend"}),
    frozenset({"main"}),
    frozenset({"workers"}),
)
"""The router's own parts, bottom to top (docs/router.md): a part imports only from the parts
below it and from itself (``frontend`` from ``runtime``, never ``execution`` from ``runtime``)."""

ROUTER = SERVICES / "router"


def _router_part(parts: tuple[str, ...]) -> str:
    """``config`` of ``("config",)``, ``scheduling`` of ``("scheduling", "pool")``."""
    return parts[0]


def _router_violations(relative: Path, source: str) -> list[str]:
    """The imports of ``services/router/<relative>`` that break the router's own layering."""
    layer_of = {part: index for index, layer in enumerate(ROUTER_LAYERS) for part in layer}
    part = _router_part(relative.with_suffix("").parts)
    module_parts = ("services", "router", *relative.with_suffix("").parts)
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level:
            base = module_parts[: len(module_parts) - node.level]
            if node.module:
                modules = [".".join((*base, node.module))]
            else:  # ``from .. import runtime``: each name may be a module
                modules = [".".join((*base, alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        for module in modules:
            names = module.split(".")
            if names[:2] != ["services", "router"] or len(names) < 3:
                continue
            imported = names[2]
            if imported == part:
                continue
            if imported not in layer_of or layer_of[imported] >= layer_of.get(part, -1):
                found.append(f"services/router/{relative}:{node.lineno}: {part} imports {imported}")
    return found


def test_the_routers_parts_import_only_from_the_parts_below_them() -> None:
    violations = []
    for path in sorted(ROUTER.rglob("*.py")):
        relative = path.relative_to(ROUTER)
        if relative.name == "__init__.py" and len(relative.parts) == 1:
            continue
        violations += _router_violations(relative, path.read_text(encoding="utf-8"))
    assert violations == []
    parts = {p.stem if p.is_file() else p.name for p in ROUTER.iterdir() if p.name != "__pycache__"}
    assert parts - {"__init__"} == {part for layer in ROUTER_LAYERS for part in layer}


def test_the_router_check_finds_upward_imports() -> None:
    probe = "from services.router.runtime import RouterRuntime\n"
    assert _router_violations(Path("execution/fork.py"), probe)
    assert _router_violations(Path("execution/fork.py"), "from .. import runtime\n")
    assert _router_violations(Path("scheduling/pool.py"), "from ..execution import fork\n")
    assert _router_violations(Path("frontend/vllm/app.py"), "import services.router.main\n")
    assert _router_violations(Path("metrics.py"), "from .scheduling.health import X\n")
    assert _router_violations(Path("frontend/ops.py"), probe) == []
    assert _router_violations(Path("execution/fork.py"), "from . import migration\n") == []

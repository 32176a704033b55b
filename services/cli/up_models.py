"""The base models one ``pdserve up`` serves, each with its own prefill and decode pools.

``--model DIR[,KEY=VALUE...]`` (repeatable, :mod:`services.cli.model_spec`) names one base
model each; its keys set that model's pools (``prefill-replicas``, ``prefill-pp``,
``prefill-tp``, ``decode-replicas``, ``decode-pp``, ``decode-tp``; the run-wide flags of the
same names are their defaults) and its front end's vLLM flags (``frontend-arg``). Without
``--model`` the run serves one model: the tiny checkpoint (or, for the engines that load none,
their own). One model is a list of one: every engine, the router's front ends and the
readiness display come from the same list.

Engines register a model by its folder's name, so two models' folders must be named apart.
Engines are named ``<role>-<index>`` with the index counted over every model's engines of
the role, in the order the models were given (the first model's names are a run of one
model's).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from services.cli.model_spec import ModelSpec, parse_model_spec

LAYOUT_KEYS = (
    "prefill-replicas",
    "prefill-pp",
    "prefill-tp",
    "decode-replicas",
    "decode-pp",
    "decode-tp",
)
"""The pool options of one ``--model`` (each defaults to the run-wide flag of its name)."""


@dataclass(frozen=True)
class PoolLayout:
    """One role's pool of one model: how many engines, and each one's PP x TP."""

    replicas: int
    pp: int
    tp: int


@dataclass(frozen=True)
class UpModel:
    """One base model of the run and its pools."""

    path: Path | None
    """Its checkpoint folder; ``None`` for the engines that load no model (stub, sim)."""
    pools: dict[str, PoolLayout]
    """``prefill`` and ``decode`` (``decode`` only with ``--colocated``)."""
    frontend_args: tuple[str, ...] = field(default=())
    """vLLM flags of this model's front end alone."""


def model_spec(text: str) -> ModelSpec:
    """argparse's ``type`` of ``pdserve up --model``."""
    return parse_model_spec(text, LAYOUT_KEYS)


def up_models(args: argparse.Namespace, default: Path | None) -> list[UpModel]:
    """The run's models: each ``--model``, or ``default`` (the tiny checkpoint, ``None`` for
    model-free engines) when none is given. ``ValueError`` when two share a folder name or
    when ``--autoscale`` would size several models' pools."""
    specs: list[ModelSpec] = list(args.model)
    if not specs:
        if default is None:
            return [UpModel(None, _pools(args, None))]
        specs = [ModelSpec(default)]
    models = [
        UpModel(spec.path.resolve(), _pools(args, spec), spec.frontend_args) for spec in specs
    ]
    names = [model.path.name for model in models if model.path is not None]
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ValueError(
            f"two --model folders are named {', '.join(doubled)}: engines register a model "
            "by its folder's name, so each model's folder needs its own"
        )
    if len(models) > 1 and args.autoscale:
        raise ValueError("--autoscale sizes one model's pools: not with several --model")
    return models


def _pools(args: argparse.Namespace, spec: ModelSpec | None) -> dict[str, PoolLayout]:
    def layout(role: str) -> PoolLayout:
        def option(what: str) -> int:
            default: int = getattr(args, f"{role}_{what}")
            return spec.integer(f"{role}-{what}", default) if spec is not None else default

        return PoolLayout(option("replicas"), option("pp"), option("tp"))

    roles = ("decode",) if args.colocated else ("prefill", "decode")
    return {role: layout(role) for role in roles}


def engine_names(models: list[UpModel]) -> list[tuple[UpModel, str, int]]:
    """``(model, role, index)`` of every engine of the run: each role's indices counted over
    the models in order (engine ``<role>-<index>``), prefill engines first."""
    engines: list[tuple[UpModel, str, int]] = []
    for role in ("prefill", "decode"):
        index = 0
        for model in models:
            pool = model.pools.get(role)
            for _ in range(pool.replicas if pool is not None else 0):
                engines.append((model, role, index))
                index += 1
    return engines

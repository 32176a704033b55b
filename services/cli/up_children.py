"""The children ``pdserve up`` starts, as command lines: every model's prefill and decode
engines (with vLLM for CPU sharing the machine's cores among them), the router with one vLLM
front end per model, and the planner of ``--autoscale``. :mod:`services.cli.up` starts and
supervises them."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from services.cli.model_spec import format_model_spec
from services.cli.up_args import TINY_MODEL_DIR
from services.cli.up_autoscale import planner_argv_flags
from services.cli.up_models import UpModel, engine_names
from services.engines.registry import synthetic_model
from services.engines.vllm.platform import (
    THREADS_BIND_ENV,
    Platform,
    installed_platform,
    shared_cpu_bindings,
)
from services.serving.ready import pdserve_argv
from services.supervision import ChildProcess
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint

MODEL_FREE_ENGINES = frozenset({"stub", "sim"})
"""Engines that load no model: ``pdserve up`` makes no tiny checkpoint for them."""


def model_dir(args: argparse.Namespace) -> Path | None:
    """The model of a run without ``--model``: the tiny checkpoint (made on first use), none
    for the engines that load no model."""
    if args.engine in MODEL_FREE_ENGINES or args.model:
        return None
    model: Path = args.work_dir / TINY_MODEL_DIR
    if not (model / "config.json").is_file():
        # Imported here: torch, which only this path needs.
        from services.engines.reference.tiny_model import make_tiny_model  # noqa: PLC0415

        print(f"pdserve up: generating the tiny test model into {model}", flush=True)
        make_tiny_model(model)
    return model.resolve()


def engine_children(
    args: argparse.Namespace,
    models: list[UpModel],
    common: list[str],
    logs: Path,
    secrets: dict[str, str],
) -> list[ChildProcess]:
    """Every model's prefill and decode engines (:func:`engine_names`)."""
    engines = engine_names(models)
    children = [
        engine_child(args, model, common, logs, secrets, role, index)
        for model, role, index in engines
    ]
    if args.engine == "vllm":
        world_sizes = [model.pools[role].pp * model.pools[role].tp for model, role, _ in engines]
        _bind_vllm_cpu_threads(children, world_sizes)
    return children


def engine_child(
    args: argparse.Namespace,
    model: UpModel,
    common: list[str],
    logs: Path,
    secrets: dict[str, str],
    role: str,
    index: int,
) -> ChildProcess:
    """Engine ``<role>-<index>`` of ``model``, with its layout for the role and every
    engine flag."""
    pp, tp = model.pools[role].pp, model.pools[role].tp
    name = f"{role}-{index}"
    argv = pdserve_argv(
        role,
        *common,
        "--engine",
        args.engine,
        "--engine-id",
        name,
        "--pp",
        str(pp),
        "--tp",
        str(tp),
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "0",
        *(["--model", str(model.path)] if model.path is not None else []),
        *(["--block-size", str(args.block_size)] if args.block_size else []),
        *(["--dtype", args.dtype] if args.dtype else []),
        *(["--sim-profile", args.sim_profile] if args.sim_profile else []),
        *_lora_argv(args),
        *args.engine_arg,
    )
    return ChildProcess(name, argv, logs / f"{name}.log", role=role, env=secrets)


def _lora_argv(args: argparse.Namespace) -> list[str]:
    """The LoRA flags of every engine and of the router's front end (both spell them as
    vLLM does): ``--enable-lora`` and the adapters to load at start."""
    if not (args.enable_lora or args.lora_modules):
        return []
    return ["--enable-lora", *(["--lora-modules", *args.lora_modules] if args.lora_modules else [])]


def planner_child(args: argparse.Namespace, router_url: str, logs: Path) -> ChildProcess:
    """``pdserve planner`` over this run's router, its metrics on a free port."""
    argv = pdserve_argv(
        "planner",
        "--router-url",
        router_url,
        "--metrics-port",
        "0",
        *planner_argv_flags(args.sim_profile, args.planner_arg),
    )
    return ChildProcess("planner", argv, logs / "planner.log", role="planner")


def _bind_vllm_cpu_threads(engines: list[ChildProcess], world_sizes: list[int]) -> None:
    """vLLM for CPU: share this machine's cores among every engine's ranks
    (:func:`~services.engines.vllm.platform.shared_cpu_bindings`), unless the operator set
    ``VLLM_CPU_OMP_THREADS_BIND`` (then each engine derives nothing and uses theirs)."""
    if installed_platform() is not Platform.CPU or os.environ.get(THREADS_BIND_ENV):
        return
    bindings = shared_cpu_bindings(world_sizes, sorted(os.sched_getaffinity(0)))
    for child, binding in zip(engines, bindings, strict=True):
        child.env[THREADS_BIND_ENV] = binding


def router_child(
    args: argparse.Namespace,
    models: list[UpModel],
    common: list[str],
    logs: Path,
    secrets: dict[str, str],
) -> ChildProcess:
    argv = pdserve_argv(
        "router",
        *common,
        "--host",
        args.host,
        "--port",
        str(args.port),
        *frontend_argv(args, models),
        *(["--colocated"] if args.colocated else []),
        *(["--workers", str(args.router_workers)] if args.router_workers != 1 else []),
        *args.router_arg,
    )
    return ChildProcess("router", argv, logs / "router.log", role="router", env=secrets)


def frontend_argv(args: argparse.Namespace, models: list[UpModel]) -> list[str]:
    """The router's front ends (vLLM's), one per model (``pdserve router --model``): the
    checkpoint each reads and its own vLLM flags; the run's flags for all of them
    (``--frontend-arg``; the engines' context, their ``--max-model-len``). A model's
    checkpoint is its engines', or for the engines that load none (stub, sim) the synthetic
    one of the model they register, written into the work folder."""
    served: list[str] = []
    for model in models:
        if model.path is not None:
            served.append(format_model_spec(model.path, {}, model.frontend_args))
            continue
        synthetic = synthetic_model(
            args.engine, sim_profile=args.sim_profile, stub_vocab_size=_stub_vocab(args)
        )
        checkpoint = write_synthetic_checkpoint(
            args.work_dir / f"{synthetic.name}-checkpoint",
            vocab_size=synthetic.vocab_size,
            max_model_len=synthetic.max_model_len,
        )
        options = {"name": synthetic.name}
        served.append(format_model_spec(checkpoint, options, model.frontend_args))
    flags = [*_lora_argv(args), *args.frontend_arg]
    for index, arg in enumerate(args.engine_arg):
        if arg.startswith("--max-model-len="):
            flags.append(arg)
        elif arg == "--max-model-len" and index + 1 < len(args.engine_arg):
            flags.append(f"--max-model-len={args.engine_arg[index + 1]}")
    return [
        *(f"--model={spec}" for spec in served),
        *(f"--frontend-arg={flag}" for flag in flags),
    ]


def _stub_vocab(args: argparse.Namespace) -> int | None:
    """``--stub-vocab-size`` among the engines' flags (benchmarks set it), else ``None``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--stub-vocab-size", type=int)
    known, _ = parser.parse_known_args(args.engine_arg)
    value: int | None = known.stub_vocab_size
    return value

"""``pdserve bench routing --lora N``: the multi-turn workload on the base model and split over
``N`` LoRA adapters, side by side in one run (issue 48's goal: placement keeps each adapter's
prefixes together, so the workload caches at least as much with adapters as with one model).

For each routing setting and router worker count, two fresh ``pdserve up --engine vllm`` stacks
with the same engines and the same workload (``services.bench.routing``):

- ``base``: every conversation on the base model, engines without LoRA;
- ``lora``: ``N`` random adapters of the checkpoint (``make_tiny_lora``, rank 8, one seed each;
  the tiny checkpoint is generated first when no ``--model`` is given) served from the start
  (``--lora-modules``, every engine ``--max-loras=N``), and each conversation runs with adapter
  :func:`adapter_of`: chosen by its system prompt, so the conversations that share a system
  prompt share an adapter, and the reusable tokens (both oracles key an adapter's blocks apart:
  ``routing_oracle.adapter_root``) are the base setting's.

``lora_vs_base`` puts each pair's cached shares side by side (:func:`lora_vs_base`); the
headline is ``cached_share_of_live_oracle`` (cached tokens over what any engine held of each
prompt at its send, capped per request: at most 1, whatever the order turns finish in; the
never-evict share beside it can pass 1 when a prompt finds the blocks of another still running)
with adapters against without, and ``goal_met`` says whether the adapters' is at least the base
model's (within :data:`TOLERANCE`: a run's shares move by a request or two).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.bench.up_stack import work_root

TOLERANCE = 0.02
"""How far below the base model's share the adapters' may be and still meet the goal."""

SHARES = ("cached_share_of_live_oracle", "prefill_cached_share", "decode_cached_share")
"""The figures :func:`lora_vs_base` compares, the headline first."""


def adapter_of(conversation: int, system_prompts: int, adapters: Sequence[str]) -> str | None:
    """The adapter conversation ``conversation`` runs with (``None``: the base model): its
    system prompt's (``conversation % system_prompts``, as the workload chooses it), spread
    over ``adapters`` in turn."""
    if not adapters:
        return None
    return adapters[(conversation % system_prompts) % len(adapters)]


def lora_vs_base(base: dict[str, Any], lora: dict[str, Any]) -> dict[str, Any]:
    """Each of :data:`SHARES` with adapters beside without, the reusable and cached tokens of
    both, and whether the goal is met (the headline share with adapters is above 0 and at least
    the base model's, less :data:`TOLERANCE`; not met when either is missing or a run had
    errors)."""
    row: dict[str, Any] = {
        key: {"lora": lora.get(key), "base": base.get(key)}
        for key in (*SHARES, "reusable_tokens", "cached_tokens", "errors")
    }
    headline, baseline = lora.get(SHARES[0]), base.get(SHARES[0])
    row["goal_met"] = (
        headline is not None
        and baseline is not None
        and headline > 0
        and not lora.get("errors")
        and not base.get("errors")
        and headline >= baseline - TOLERANCE
    )
    return row


RunSetting = Callable[..., dict[str, Any]]
"""``routing._run_setting``: ``(args, policy, workers, work_dir, *, up_args, adapters)``."""


def run_lora(
    args: argparse.Namespace,
    policies: Sequence[str],
    workers: Sequence[int],
    run_setting: RunSetting,
    workload: dict[str, Any],
) -> dict[str, Any]:
    """Both settings per policy and worker count; see the module docstring."""
    if args.engine != "vllm":
        raise SystemExit("pdserve bench routing --lora: needs --engine vllm (adapters run on vLLM)")
    results: dict[str, Any] = {}
    comparison: dict[str, Any] = {}
    with work_root(args.work_dir, "routing-lora") as root:
        args = argparse.Namespace(**vars(args))
        args.model, adapters = make_adapters(root, args.model, args.lora)
        names = list(adapters)
        up_args = [
            "--lora-modules",
            *(f"{name}={path}" for name, path in adapters.items()),
            f"--engine-arg=--max-loras={len(adapters)}",
        ]
        for count in workers:
            for policy in policies:
                name = f"{policy}/workers={count}"
                base = run_setting(
                    _turns_under(args, "base"), policy, count, root / f"{policy}-{count}-base"
                )
                lora = run_setting(
                    _turns_under(args, "lora"),
                    policy,
                    count,
                    root / f"{policy}-{count}-lora",
                    up_args=up_args,
                    adapters=names,
                )
                results[f"{name}/base"], results[f"{name}/lora"] = base, lora
                comparison[name] = lora_vs_base(base, lora)
    return {
        "workload": {**workload, "adapters": names},
        "settings": results,
        "lora_vs_base": comparison,
    }


def _turns_under(args: argparse.Namespace, setting: str) -> argparse.Namespace:
    """``args`` with ``--turns-out`` in a folder of ``setting``'s own."""
    if args.turns_out is None:
        return args
    return argparse.Namespace(**{**vars(args), "turns_out": args.turns_out / setting})


def make_adapters(root: Path, model: Path | None, count: int) -> tuple[Path, dict[str, Path]]:
    """The checkpoint (``model``, or the tiny one generated into ``root``) and ``count`` random
    adapters of it, ``lora-0``, ``lora-1``, ... (generated under ``root/adapters``)."""
    # Lazy: torch and safetensors, which only this mode of the bench needs.
    from services.engines.reference.tiny_lora import make_tiny_lora  # noqa: PLC0415
    from services.engines.reference.tiny_model import make_tiny_model  # noqa: PLC0415

    if model is None:
        model = root / "tiny-model"
        if not (model / "config.json").exists():
            make_tiny_model(model)
    adapters = {
        f"lora-{index}": make_tiny_lora(root / "adapters" / f"lora-{index}", model, seed=index + 1)
        for index in range(count)
    }
    return model, adapters

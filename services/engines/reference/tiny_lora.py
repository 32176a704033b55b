"""A random LoRA adapter for a checkpoint of :mod:`.tiny_model`, in the PEFT layout.

``make_tiny_lora(directory, model_dir)`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` as PEFT saves them (``base_model.model.<module>.lora_A.weight``
of shape ``[rank, in]`` and ``lora_B.weight`` of ``[out, rank]`` for the attention
projections of every layer), shaped from the checkpoint's ``config.json``. Nothing is
downloaded and ``peft`` is not needed; the same arguments give the same bytes. The weights are
large enough that the adapter changes the model's greedy answers (what tests compare).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGET_MODULES = ("q_proj", "v_proj", "o_proj")


def make_tiny_lora(
    directory: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    seed: int = 1,
    alpha: int = 16,
) -> Path:
    """Write the adapter into ``directory`` (created if needed) and return its path."""
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads", heads))
    shapes = {  # (in, out) of each target projection
        "q_proj": (hidden, heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGET_MODULES:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=generator) * fan_in**-0.5
            )
            weights[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (root / "adapter_config.json").write_text(
        json.dumps(adapter_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return root

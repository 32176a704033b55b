"""A tiny, deterministic, randomly initialised Llama checkpoint in HF format.

``make_tiny_model(directory)`` writes ``config.json``, ``generation_config.json``, safetensors
weights (one file, or several with an index), a byte-level BPE ``tokenizer.json`` trained here
on a built-in text, and ``tokenizer_config.json`` with a Llama-3-style chat template. Nothing is
downloaded; the same seed and spec give the same bytes.

The default shape is chosen so every layout the tests need exists: 7 layers (PP=3 splits
unevenly 3/2/2), 4 query heads over 2 KV heads (TP=2 splits the KV heads, TP=4 replicates them),
an MLP width divisible by 4, and Llama 3 RoPE scaling whose original context (64) is short
enough that the scaled, smoothed and unscaled frequency bands all occur.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (
    BOS_TOKEN,
    END_OF_TEXT_TOKEN,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT_TOKEN,
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Training text for the BPE merges: a fixed English passage, so merges are common English
# fragments and prompts in tests tokenize to fewer ids than bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system splits the work of a language
model in two: the prefill reads the whole prompt at once, and the decode writes one token at a
time. The prefill is limited by compute and the decode by memory, so running them on separate
machines lets each be sized for its own bottleneck. Between them the key and value cache of the
prompt moves from one machine to the other, block by block, layer by layer, head by head.
Pipeline parallelism gives each stage a range of layers; tensor parallelism gives each rank a
range of heads. When the two sides are cut differently, every decode rank must find, for each
layer and head it owns, the prefill rank that holds it, and read exactly those blocks.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is
the capital of France. One, two, three, four, five, six, seven, eight, nine, ten.
The user asks a question and the assistant answers it in a short and helpful way.
"""


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape of the tiny checkpoint. ``qwen2`` adds q/k/v biases, default RoPE and tied
    embeddings, to exercise those paths."""

    model_type: Literal["llama", "qwen2"] = "llama"
    num_layers: int = 7
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 128
    vocab_size: int = 384
    max_position_embeddings: int = 512
    num_weight_files: int = 1
    """More than one writes ``model-0000i-of-0000n.safetensors`` and an index."""


def make_tiny_model(
    directory: str | Path, seed: int = 0, spec: TinyModelSpec | None = None
) -> Path:
    """Write the tiny checkpoint into ``directory`` (created if needed) and return its path.

    Weight files of an earlier checkpoint in the same folder are removed first: a stale index
    would otherwise take precedence over a new single file.
    """
    spec = spec or TinyModelSpec()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for stale in (*root.glob("model-*-of-*.safetensors"), *root.glob("model.safetensors*")):
        stale.unlink()
    tokenizer = _train_tokenizer(spec.vocab_size)
    special_ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:  # the trainer always adds them; a failure here is a bug
            raise RuntimeError(f"special token {token} missing from the trained tokenizer")
        special_ids[token] = token_id
    bos_id = special_ids[BOS_TOKEN]
    eos_ids = [special_ids[END_OF_TEXT_TOKEN], special_ids[EOT_TOKEN]]
    if tokenizer.get_vocab_size(with_added_tokens=True) > spec.vocab_size:
        raise ValueError("the tokenizer outgrew the model vocabulary")
    (root / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")

    _write_json(root / "config.json", _model_config(spec, bos_id, eos_ids))
    _write_json(root / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_ids})
    _write_json(
        root / "tokenizer_config.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOT_TOKEN,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_weights(root, _init_weights(spec, seed), spec.num_weight_files)
    return root


def main_make_tiny_model(argv: Sequence[str] | None = None) -> int:
    """``pdserve make-tiny-model DIR [--seed N] [--model-type llama|qwen2] ...``."""
    parser = argparse.ArgumentParser(
        prog="pdserve make-tiny-model",
        description="Write a tiny random Llama checkpoint in HF format (no downloads).",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-type", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--layers", type=int, default=TinyModelSpec.num_layers)
    parser.add_argument("--weight-files", type=int, default=1)
    args = parser.parse_args(argv)
    spec = TinyModelSpec(
        model_type=args.model_type, num_layers=args.layers, num_weight_files=args.weight_files
    )
    print(make_tiny_model(args.directory, args.seed, spec))
    return 0


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the built-in corpus (deterministic: counts then pair order
    break ties in the trainer)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _model_config(spec: TinyModelSpec, bos_id: int, eos_ids: list[int]) -> dict[str, object]:
    config: dict[str, object] = {
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "use_cache": True,
    }
    if spec.model_type == "qwen2":
        return config | {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": spec.num_layers,
        }
    return config | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def _init_weights(spec: TinyModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in checkpoint order from one seeded generator.

    Projections use std ``fan_in ** -0.5`` so activations keep unit scale through the layers and
    logits are spread (greedy choices are not near-ties); norm weights are ``1 + noise`` so a
    swapped or missing norm changes the output.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std + mean

    hidden, width = spec.hidden_size, spec.intermediate_size
    q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    weights = {"model.embed_tokens.weight": normal(spec.vocab_size, hidden, std=1.0)}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.input_layernorm.weight": normal(hidden, std=0.1, mean=1.0),
            f"{prefix}.self_attn.q_proj.weight": normal(q_width, hidden, std=hidden**-0.5),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_width, hidden, std=hidden**-0.5),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_width, hidden, std=hidden**-0.5),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_width, std=q_width**-0.5),
            f"{prefix}.post_attention_layernorm.weight": normal(hidden, std=0.1, mean=1.0),
            f"{prefix}.mlp.gate_proj.weight": normal(width, hidden, std=hidden**-0.5),
            f"{prefix}.mlp.up_proj.weight": normal(width, hidden, std=hidden**-0.5),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, width, std=width**-0.5),
        }
        if spec.model_type == "qwen2":
            weights |= {
                f"{prefix}.self_attn.q_proj.bias": normal(q_width, std=0.1),
                f"{prefix}.self_attn.k_proj.bias": normal(kv_width, std=0.1),
                f"{prefix}.self_attn.v_proj.bias": normal(kv_width, std=0.1),
            }
    weights["model.norm.weight"] = normal(hidden, std=0.1, mean=1.0)
    if spec.model_type != "qwen2":  # qwen2 ties lm_head to the embeddings
        weights["lm_head.weight"] = normal(spec.vocab_size, hidden, std=hidden**-0.5)
    return weights


def _write_weights(root: Path, weights: dict[str, torch.Tensor], num_files: int) -> None:
    metadata = {"format": "pt"}
    if num_files <= 1:
        save_file(weights, str(root / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    if num_files > len(names):
        raise ValueError(f"{len(names)} tensors cannot fill {num_files} weight files")
    per_file = -(-len(names) // num_files)
    weight_map: dict[str, str] = {}
    for index in range(num_files):
        file_name = f"model-{index + 1:05d}-of-{num_files:05d}.safetensors"
        part = {name: weights[name] for name in names[index * per_file : (index + 1) * per_file]}
        save_file(part, str(root / file_name), metadata=metadata)
        weight_map |= dict.fromkeys(part, file_name)
    total_size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    _write_json(
        root / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": weight_map},
    )


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")

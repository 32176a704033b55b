"""The model configuration the reference engine reads from a Hugging Face ``config.json``.

Only the Llama family is implemented: ``llama``, ``mistral`` (without a sliding window) and
``qwen2`` (q/k/v bias, without a sliding window). Both spellings of RoPE settings are read:
the classic top-level ``rope_theta`` + ``rope_scaling`` (what checkpoints on the Hub carry) and
the ``rope_parameters`` block that transformers 5 writes. Anything else fails here, at start-up,
with :class:`UnsupportedModelError` rather than producing wrong logits later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.engines.errors import ModelConfigError, UnsupportedModelError

CONFIG_FILE = "config.json"

RopeType = Literal["default", "linear", "llama3"]
ModelDtype = Literal["float32", "float16", "bfloat16"]

# model_type -> the architecture name transformers gives its causal-LM class.
SUPPORTED_MODEL_TYPES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
_SUPPORTED_DTYPES: tuple[ModelDtype, ...] = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` ignores every other field.

    ``linear`` divides every frequency by ``factor``. ``llama3`` divides only the low
    frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``) by
    ``factor``, keeps the high ones, and interpolates between.
    """

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape and numerics, as the reference engine needs them.

    Built with :meth:`from_dict` / :meth:`from_directory`, which validate every field; an
    instance is therefore always a model the engine can run (shard-specific limits, such as
    heads dividing over TP, are checked when a shard is cut).
    """

    model_type: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    qkv_bias: bool
    """q_proj, k_proj and v_proj carry a bias (Llama ``attention_bias``; always for Qwen2)."""
    o_bias: bool
    """o_proj carries a bias (Llama ``attention_bias``; never for Qwen2)."""
    mlp_bias: bool
    dtype: ModelDtype
    """The dtype the checkpoint was saved in (``torch_dtype``, or ``dtype`` in transformers 5)."""
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_directory(cls, directory: str | Path) -> ModelConfig:
        """Read ``config.json`` from a local checkpoint folder."""
        path = Path(directory) / CONFIG_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ModelConfigError(f"no {CONFIG_FILE} in {directory}") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} is not a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> ModelConfig:
        """Parse and validate the fields of an HF config.

        Raises :class:`ModelConfigError` for missing or ill-typed fields and
        :class:`UnsupportedModelError` for a model family or feature that is not implemented.
        """
        model_type = _str(raw, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        architecture = SUPPORTED_MODEL_TYPES[model_type]
        architectures = raw.get("architectures")
        if architectures is not None and (
            not isinstance(architectures, list) or architecture not in architectures
        ):
            raise UnsupportedModelError(
                f"architectures {architectures!r} do not include {architecture}; only the "
                "causal-LM head is supported"
            )
        _check_unsupported_features(raw, model_type)

        hidden_size = _positive_int(raw, "hidden_size", None)
        num_heads = _positive_int(raw, "num_attention_heads", None)
        num_kv_heads = _positive_int(raw, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        default_head_dim = hidden_size // num_heads
        head_dim = _positive_int(raw, "head_dim", default_head_dim)
        if raw.get("head_dim") is None and hidden_size % num_heads:
            raise ModelConfigError(
                f"hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads} "
                "and no head_dim is given"
            )
        rope_theta, rope_scaling = _parse_rope(raw)
        attention_bias = _bool(raw, "attention_bias", False)
        is_qwen2 = model_type == "qwen2"
        return cls(
            model_type=model_type,
            architecture=architecture,
            hidden_size=hidden_size,
            intermediate_size=_positive_int(raw, "intermediate_size", None),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers", None),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=_positive_int(raw, "vocab_size", None),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", 2048),
            rms_norm_eps=_positive_float(raw, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=_bool(raw, "mlp_bias", False),
            dtype=_parse_dtype(raw),
            bos_token_id=_optional_int(raw, "bos_token_id"),
            eos_token_ids=_token_ids(raw, "eos_token_id"),
        )


def _check_unsupported_features(raw: Mapping[str, object], model_type: str) -> None:
    """Reject configs whose numerics this engine would silently get wrong."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
    if model_type == "qwen2" and raw.get("use_sliding_window") is True:
        raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
    if model_type == "mistral" and raw.get("sliding_window") is not None:
        raise UnsupportedModelError(
            "Mistral with a sliding_window is not supported (set it to null for full attention)"
        )


def _parse_rope(raw: Mapping[str, object]) -> tuple[float, RopeScaling]:
    """``(rope_theta, scaling)`` from either the classic or the transformers-5 spelling."""
    params = raw.get("rope_parameters")
    scaling_raw: object
    if params is not None:
        if not isinstance(params, dict):
            raise ModelConfigError("rope_parameters must be an object")
        if "rope_type" not in params and "type" not in params:
            # transformers 5 nests per-layer-type parameters for hybrid models.
            raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
        theta = _positive_float(params, "rope_theta", _positive_float(raw, "rope_theta", 10000.0))
        scaling_raw = params
    else:
        theta = _positive_float(raw, "rope_theta", 10000.0)
        scaling_raw = raw.get("rope_scaling")
    if scaling_raw is None:
        return theta, RopeScaling()
    if not isinstance(scaling_raw, dict):
        raise ModelConfigError("rope_scaling must be an object or null")
    # Older configs spell the key "type".
    rope_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default"))
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=_positive_float(scaling_raw, "factor", None))
    if rope_type == "llama3":
        scaling = RopeScaling(
            "llama3",
            factor=_positive_float(scaling_raw, "factor", None),
            low_freq_factor=_positive_float(scaling_raw, "low_freq_factor", None),
            high_freq_factor=_positive_float(scaling_raw, "high_freq_factor", None),
            original_max_position_embeddings=_positive_int(
                scaling_raw, "original_max_position_embeddings", None
            ),
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise ModelConfigError("llama3 rope_scaling needs high_freq_factor > low_freq_factor")
        return theta, scaling
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


def _parse_dtype(raw: Mapping[str, object]) -> ModelDtype:
    value = raw.get("torch_dtype", raw.get("dtype", "float32"))
    if value is None:
        return "float32"
    for dtype in _SUPPORTED_DTYPES:
        if value == dtype:
            return dtype
    raise UnsupportedModelError(f"checkpoint dtype {value!r} is not supported")


def _str(raw: Mapping[str, object], key: str, default: str | None) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise ModelConfigError(f"{key} must be a string, got {value!r}")
    return value


def _positive_int(raw: Mapping[str, object], key: str, default: int | None) -> int:
    value = raw.get(key)
    if value is None:
        value = default
    # bool is an int subclass; true is never a size.
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _positive_float(raw: Mapping[str, object], key: str, default: float | None) -> float:
    value = raw.get(key)
    if value is None:
        value = default
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ModelConfigError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _bool(raw: Mapping[str, object], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _optional_int(raw: Mapping[str, object], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelConfigError(f"{key} must be a token id, got {value!r}")
    return value


def _token_ids(raw: Mapping[str, object], key: str) -> tuple[int, ...]:
    """A token id or list of ids (``eos_token_id`` is either in HF configs)."""
    value = raw.get(key)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    ids: list[int] = []
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ModelConfigError(f"{key} must be a token id or a list of them, got {value!r}")
        ids.append(item)
    return tuple(ids)

"""Parsing HF ``config.json`` into ``ModelConfig``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.engines.errors import ModelConfigError, UnsupportedModelError
from services.engines.reference.config import ModelConfig, RopeScaling

LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama_3_1_config_is_parsed_with_defaults_filled_in():
    config = ModelConfig.from_dict(LLAMA_3_8B)

    assert config.architecture == "LlamaForCausalLM"
    assert config.head_dim == 128  # hidden_size / num_attention_heads
    assert config.num_queries_per_kv == 4
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.dtype == "bfloat16"
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (False, False, False)


def test_transformers_5_rope_parameters_read_like_the_classic_spelling():
    classic = ModelConfig.from_dict(LLAMA_3_8B)
    modern = dict(LLAMA_3_8B)
    del modern["rope_scaling"], modern["rope_theta"], modern["torch_dtype"]
    modern["dtype"] = "bfloat16"
    modern["rope_parameters"] = {**LLAMA_3_8B["rope_scaling"], "rope_theta": 500000.0}

    assert ModelConfig.from_dict(modern) == classic


def test_qwen2_has_qkv_bias_but_no_output_bias():
    raw = {**LLAMA_3_8B, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    raw |= {"rope_scaling": None, "use_sliding_window": False, "sliding_window": 131072}

    config = ModelConfig.from_dict(raw)

    assert (config.qkv_bias, config.o_bias) == (True, False)
    assert config.rope_scaling.rope_type == "default"


def test_llama_attention_bias_covers_every_attention_projection():
    config = ModelConfig.from_dict({**LLAMA_3_8B, "attention_bias": True, "eos_token_id": 2})
    assert (config.qkv_bias, config.o_bias) == (True, True)
    assert config.eos_token_ids == (2,)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "causal-LM"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
        ({"torch_dtype": "float8_e4m3fn"}, "dtype"),
        ({"model_type": "mistral", "architectures": None, "sliding_window": 4096}, "sliding"),
    ],
)
def test_unsupported_models_fail_with_a_clear_error(changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**LLAMA_3_8B, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_key_value_heads": 5}, "multiple"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": [1, "two"]}, "eos_token_id"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_malformed_configs_name_the_bad_field(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**LLAMA_3_8B, **changes})


def test_from_directory_reports_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        ModelConfig.from_directory(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        ModelConfig.from_directory(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    assert ModelConfig.from_directory(tmp_path).num_hidden_layers == 32

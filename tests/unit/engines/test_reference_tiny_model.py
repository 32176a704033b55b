"""The generated tiny checkpoint: byte-for-byte deterministic, loadable, and generating the same
tokens every time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.engines.reference.config import ModelConfig
from services.engines.reference.tiny_model import main_make_tiny_model, make_tiny_model
from services.tokenization.tokenizer import load_tokenizer


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_same_seed_gives_the_same_bytes_even_in_another_process(tmp_path, tiny_llama):
    script = "import sys; from services.engines.reference.tiny_model import make_tiny_model; "
    script += "make_tiny_model(sys.argv[1], seed=0)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    repo_root = Path(__file__).resolve().parents[3]  # `-c` imports services from the cwd
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "again")], check=True, env=env, cwd=repo_root
    )

    assert _files(tmp_path / "again") == _files(tiny_llama)


def test_another_seed_changes_only_the_weights(tmp_path, tiny_llama):
    other = _files(make_tiny_model(tmp_path / "other", seed=1))
    same = _files(tiny_llama)

    assert other["model.safetensors"] != same["model.safetensors"]
    assert {name: data for name, data in other.items() if name != "model.safetensors"} == {
        name: data for name, data in same.items() if name != "model.safetensors"
    }


def test_default_shape_supports_the_layouts_under_test(tiny_llama):
    config = ModelConfig.from_directory(tiny_llama)

    assert config.num_hidden_layers == 7  # PP=3 is uneven
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)  # TP=4 > KV heads
    assert config.intermediate_size % 4 == 0
    assert config.rope_scaling.rope_type == "llama3"
    assert load_tokenizer(tiny_llama).vocab_size <= config.vocab_size


def test_greedy_generation_is_deterministic(tiny_llama, make_group, greedy):
    prompt = load_tokenizer(tiny_llama).encode("The quick brown fox")

    first, _ = greedy(make_group(tiny_llama), prompt, 8)
    second, _ = greedy(make_group(tiny_llama), prompt, 8)

    assert first == second
    assert len(set(first)) > 1  # not a degenerate constant output


def test_cli_entry_point_writes_a_loadable_checkpoint(tmp_path, capsys):
    assert (
        main_make_tiny_model([str(tmp_path / "cli"), "--layers", "3", "--weight-files", "2"]) == 0
    )

    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert ModelConfig.from_directory(tmp_path / "cli").num_hidden_layers == 3
    assert (tmp_path / "cli" / "model.safetensors.index.json").is_file()

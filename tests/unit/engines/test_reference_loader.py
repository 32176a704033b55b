"""Loading checkpoints: single file, sharded with an index, partial reads, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engines.errors import CheckpointError, ModelConfigError
from services.engines.reference.loader import INDEX_FILE, checkpoint_index, load_model
from services.engines.reference.sharding import ShardSpec
from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from services.topology import Range


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path):
    single = make_tiny_model(tmp_path / "single", seed=3)
    sharded = make_tiny_model(tmp_path / "sharded", seed=3, spec=TinyModelSpec(num_weight_files=4))
    assert len(set(checkpoint_index(sharded).values())) == 4

    a, b = load_model(single), load_model(sharded)

    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_a_shard_needs_only_the_files_holding_its_tensors(tmp_path):
    directory = make_tiny_model(tmp_path / "m", spec=TinyModelSpec(num_weight_files=3))
    first_file = directory / "model-00001-of-00003.safetensors"
    assert "model.embed_tokens.weight" in load_file(first_file)
    first_file.unlink()
    index = json.loads((directory / INDEX_FILE).read_text())
    index["weight_map"] = {
        name: file for name, file in index["weight_map"].items() if file != first_file.name
    }
    (directory / INDEX_FILE).write_text(json.dumps(index))

    last_stage = load_model(directory, ShardSpec(Range(5, 7)))  # in the last file only

    assert last_stage.lm_head is not None
    with pytest.raises(CheckpointError, match=r"missing .* model\.embed_tokens\.weight"):
        load_model(directory)


def test_a_tensor_of_the_wrong_shape_is_reported_by_name(tmp_path):
    directory = make_tiny_model(tmp_path / "m")
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.2.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(weights, directory / "model.safetensors")

    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(directory)


def test_missing_or_broken_files_raise_checkpoint_errors(tmp_path):
    directory = make_tiny_model(tmp_path / "m")
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(directory)

    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(directory)

    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"gone\.safetensors"):
        load_model(directory)


def test_a_folder_without_config_is_a_config_error(tmp_path, tiny_llama):
    shutil.copy(tiny_llama / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        load_model(tmp_path)


def test_weights_are_cast_to_the_requested_dtype(tiny_llama):
    model = load_model(tiny_llama, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.allocate_kv_cache(2, 4).keys[0].dtype == torch.bfloat16

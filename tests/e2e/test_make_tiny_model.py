"""``pdserve make-tiny-model DIR``: a checkpoint the reference engine and transformers can load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_make_tiny_model_writes_a_loadable_checkpoint_twice_identically(tmp_path: Path) -> None:
    outputs = []
    for name in ("a", "b"):
        target = tmp_path / name
        result = subprocess.run(
            [sys.executable, "-m", "services.cli.main", "make-tiny-model", str(target),
             "--seed", "3"],
            capture_output=True, text=True, check=True, timeout=300,
        )  # fmt: skip
        assert str(target) in result.stdout
        outputs.append(target)
    config = json.loads((outputs[0] / "config.json").read_text())
    assert config["num_hidden_layers"] >= 3
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (outputs[0] / file).read_bytes() == (outputs[1] / file).read_bytes(), file

"""The engines' LoRA flags (issue 48): ``pdserve prefill|decode --enable-lora --max-loras N
--max-lora-rank R --lora-modules NAME=PATH`` reach vLLM's engine arguments and the engine's
registered slots; the reference engine refuses them; the sizing flags need ``--enable-lora``."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.registry import EngineOptions, EngineOptionsError, create_backend
from services.engines.vllm.backend import VllmBackend
from services.engines.vllm.options import lora_args


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora-options") / "tiny")


def test_lora_flags_reach_vllms_arguments_and_the_registered_slots(model: Path) -> None:
    flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"]
    args = build_parser().parse_args(
        ["decode", *flags, "--lora-modules", "sql=/a/sql", "chat=/a/chat"]
    )
    assert args.enable_lora and args.max_loras == 3 and args.max_lora_rank == 32
    assert args.lora_modules == [("sql", "/a/sql"), ("chat", "/a/chat")]
    options = EngineOptions(
        model_dir=model,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=32,
        lora_modules=(("sql", "/a/sql"),),
    )
    backend = create_backend("vllm", options)
    assert isinstance(backend, VllmBackend)
    assert backend.describe().max_loras == 3
    assert backend.options.lora_modules == (("sql", "/a/sql"),)
    assert lora_args(backend.options) == {
        "enable_lora": True,
        "max_loras": 3,
        "max_lora_rank": 32,
        "max_cpu_loras": None,
    }
    plain = create_backend("vllm", EngineOptions(model_dir=model))
    assert isinstance(plain, VllmBackend)
    assert plain.describe().max_loras == 0 and lora_args(plain.options) == {}
    modules_only = create_backend(
        "vllm", EngineOptions(model_dir=model, lora_modules=(("a", "/a"),))
    )
    assert modules_only.describe().max_loras == 1  # --lora-modules implies --enable-lora


def test_lora_flags_are_refused_where_they_would_be_ignored(model: Path) -> None:
    with pytest.raises(EngineOptionsError, match="does not take --enable-lora"):
        create_backend("reference", EngineOptions(model_dir=model, enable_lora=True))
    with pytest.raises(EngineOptionsError, match="--max-loras need --enable-lora"):
        create_backend("vllm", EngineOptions(model_dir=model, max_loras=2))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--lora-modules", "no-path"])

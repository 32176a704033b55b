"""``pdserve up``'s router front end: vLLM's for every engine that serves a checkpoint, pdserve's
own for the model-free engines (whose byte tokenizer vLLM cannot load), ``--frontend`` first."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.cli.up import _frontend_argv


def frontend_of(*argv: str, model: Path | None) -> list[str]:
    return _frontend_argv(build_parser().parse_args(["up", *argv]), model)


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_an_engine_with_a_checkpoint_gets_vllms_front_end(engine: str, tmp_path: Path) -> None:
    argv = frontend_of(
        "--engine", engine, "--engine-arg=--max-model-len=256", "--frontend-arg=--a", model=tmp_path
    )
    context = "--frontend-arg=--max-model-len=256"  # the engines' context is the front end's
    assert argv == ["--frontend", "vllm", "--frontend-arg=--a", context]


@pytest.mark.parametrize("engine", ["stub", "sim"])
def test_model_free_engines_get_pdserves_front_end(engine: str) -> None:
    assert frontend_of("--engine", engine, model=None) == ["--frontend", "pdserve"]


def test_the_frontend_flag_decides(tmp_path: Path) -> None:
    # (passed on: the router's own default would pick vLLM's for the checkpoint)
    assert frontend_of("--frontend", "pdserve", model=tmp_path) == ["--frontend", "pdserve"]
    assert frontend_of("--engine", "stub", "--frontend", "vllm", model=None)[:2] == [
        "--frontend",
        "vllm",
    ]

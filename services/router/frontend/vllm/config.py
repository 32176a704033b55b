"""What vLLM's OpenAI front end needs, built without an engine: its flags, config and renderer.

:func:`frontend_args` parses vLLM's own ``vllm serve`` flags (``--chat-template``,
``--tool-call-parser``, ``--reasoning-parser``, ``--max-model-len``...), so the router takes
exactly the front-end options vLLM's server takes, spelled as vLLM spells them.
:func:`build_frontend` follows vLLM's CPU-only render server
(``vllm/entrypoints/launchers/render/entry.py``): the model config from the checkpoint's files
(no weights are read, no process or thread started), then the renderer and the input processor
as ``AsyncLLM`` builds them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm import AsyncEngineArgs
from vllm.config import VllmConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.renderers import renderer_from_config
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.input_processor import InputProcessor


@dataclass(frozen=True)
class Frontend:
    """The parts of vLLM's front end that do not need an engine."""

    args: argparse.Namespace
    """vLLM's parsed server flags (``app.state.args`` of vLLM's own server)."""
    vllm_config: Any
    """``vllm.config.VllmConfig`` with the model config only."""
    renderer: Any
    """``vllm.renderers.BaseRenderer``: tokenizer, chat templates, prompt rendering."""
    input_processor: Any
    """``vllm.v1.engine.input_processor.InputProcessor``: request validation (structured
    outputs, token ids, context) into an ``EngineCoreRequest``."""

    @property
    def served_model_name(self) -> str:
        return str(self.args.served_model_name[0])


def frontend_args(
    model_dir: Path, served_model_name: str, flags: Sequence[str] = ()
) -> argparse.Namespace:
    """vLLM's server flags for ``model_dir`` served as ``served_model_name``, ``flags`` on top
    (``SystemExit`` with vLLM's usage message on a bad flag, as ``vllm serve``)."""
    parser = make_arg_parser(FlexibleArgumentParser(prog="pdserve router --frontend-arg"))
    args: argparse.Namespace = parser.parse_args(
        ["--model", str(model_dir), "--served-model-name", served_model_name, *flags]
    )
    validate_parsed_serve_args(args)
    return args


def build_frontend(args: argparse.Namespace) -> Frontend:
    """The config, renderer and input processor of vLLM's front end for ``args``."""
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # as vLLM's render server: no weights are loaded here
    vllm_config = VllmConfig(
        model_config=model_config,
        logging_config=engine_args.create_logging_config(),
        structured_outputs_config=engine_args.create_structured_outputs_config(),
    )
    renderer = renderer_from_config(vllm_config)
    return Frontend(
        args=args,
        vllm_config=vllm_config,
        renderer=renderer,
        input_processor=InputProcessor(vllm_config, renderer),
    )

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
from vllm.config import LoRAConfig, VllmConfig
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


SERVER_FLAGS: dict[str, str] = {
    **dict.fromkeys(
        ("host", "port", "uds", "headless", "api_server_count", "grpc", "grpc_port"),
        "the router's own listener: pdserve router --host/--port, pdserve up --port",
    ),
    **dict.fromkeys(
        (
            "data_parallel_supervisor_port",
            "dp_supervisor_probe_interval_s",
            "dp_supervisor_probe_timeout_s",
            "dp_supervisor_probe_failure_threshold",
        ),
        "vLLM's data-parallel API servers; pdserve's router is one process or several "
        "(pdserve router --workers)",
    ),
    **dict.fromkeys(
        (
            "ssl_keyfile",
            "ssl_certfile",
            "ssl_ca_certs",
            "enable_ssl_refresh",
            "ssl_cert_reqs",
            "ssl_ciphers",
        ),
        "the router serves plain HTTP: terminate TLS in front of it (an ingress)",
    ),
    **dict.fromkeys(
        ("uvicorn_log_level", "disable_uvicorn_access_log", "disable_access_log_for_endpoints"),
        "the router's logging: PDSERVE_ROUTER_LOG_LEVEL (it writes no access log)",
    ),
    **dict.fromkeys(
        ("h11_max_incomplete_event_size", "h11_max_header_count"),
        "the router's HTTP parser (httptools) and its body bound: "
        "PDSERVE_ROUTER_MAX_REQUEST_BODY_BYTES",
    ),
    "shutdown_timeout": "the router's graceful shutdown (10 s for requests in flight)",
}
"""vLLM server flags of what pdserve's router does itself (its listener, TLS, logging,
HTTP parser), each with where that is set instead."""

ENGINE_GROUPS = frozenset(
    {
        "ParallelConfig",
        "CacheConfig",
        "SchedulerConfig",
        "LoadConfig",
        "OffloadConfig",
        "CompilationConfig",
        "KernelConfig",
        "AttentionConfig",
        "MambaConfig",
        "ObservabilityConfig",
        "LoRAConfig",
    }
)
"""Groups of vLLM's server flags that configure the engine only (the front end builds the
model config, its structured-outputs and logging config, nothing else: :func:`build_frontend`)."""
FRONTEND_LORA_FLAGS = frozenset({"enable_lora"})
"""The one flag of vLLM's ``LoRAConfig`` group the front end applies: ``--enable-lora`` lets
requests name adapters (vLLM's input processor refuses them otherwise); the rest (ranks,
slots) configure the engines, which register their slots (``max_loras``)."""
ENGINE_FLAGS = frozenset(
    {
        "speculative_config",
        "kv_transfer_config",
        "kv_events_config",
        "ec_transfer_config",
        "ec_manager_config",
        "compilation_config",
        "attention_config",
        "engram_config",
        "kernel_config",
        "additional_config",
        "aux_output_config",
        "profiler_config",
        "optimization_level",
        "performance_mode",
        "weight_transfer_config",
        "watermark_config",
        "disable_log_stats",
        "aggregate_engine_logging",
        "gdn_prefill_backend",
        "kda_prefill_backend",
        "kda_decode_backend",
    }
)
"""Engine-only flags outside :data:`ENGINE_GROUPS` (vLLM's ``VllmConfig`` group and its
top-level options)."""


RENDERER_WORKERS = 4
"""The router's default ``--renderer-num-workers`` (vLLM's is 1): the threads that tokenize
prompts off the event loop. With one, a huge prompt (a few MB, tokenized whole when it has
``truncate_prompt_tokens``) held every other request's tokenizing for seconds (3.7 s for a
small request beside a 3 MB prompt; 8 ms with 4: ``tests/unit/router/test_tokenizing.py``).
HF ``tokenizers`` releases the GIL while it encodes, so the threads run side by side."""


def frontend_args(
    model_dir: Path, served_model_name: str, flags: Sequence[str] = ()
) -> argparse.Namespace:
    """vLLM's server flags for ``model_dir`` served as ``served_model_name``, ``flags`` on top
    (``SystemExit`` with vLLM's usage message on a bad flag, as ``vllm serve``). A flag
    ``vllm serve`` takes that the router would not apply (its listener, TLS, an engine's
    setting: :data:`SERVER_FLAGS`, :data:`ENGINE_GROUPS`, :data:`ENGINE_FLAGS`) is refused the
    same way, naming where it belongs, never accepted and ignored."""
    parser = make_arg_parser(FlexibleArgumentParser(prog="pdserve router --frontend-arg"))
    parser.set_defaults(renderer_num_workers=RENDERER_WORKERS)
    args: argparse.Namespace = parser.parse_args(
        ["--model", str(model_dir), "--served-model-name", served_model_name, *flags]
    )
    # argparse keeps its groups private; vLLM groups its flags by config class
    for group in parser._action_groups:
        for action in group._group_actions:
            if getattr(args, action.dest, action.default) == action.default:
                continue
            flag = next((o for o in action.option_strings if o.startswith("--")), action.dest)
            if action.dest in SERVER_FLAGS:
                parser.error(
                    f"{flag} is not applied by pdserve's router: {SERVER_FLAGS[action.dest]}"
                )
            if action.dest in FRONTEND_LORA_FLAGS:
                continue
            if group.title in ENGINE_GROUPS or action.dest in ENGINE_FLAGS:
                parser.error(
                    f"{flag} configures vLLM's engine, not its front end: give it to the "
                    "engines (pdserve prefill/decode flags, pdserve up --engine-arg)"
                )
    validate_parsed_serve_args(args)
    return args


def build_frontend(args: argparse.Namespace) -> Frontend:
    """The config, renderer and input processor of vLLM's front end for ``args``; with
    ``--enable-lora`` its config has a LoRA config (vLLM's defaults: the front end only asks
    whether there is one; the engines' flags size their slots)."""
    engine_args = AsyncEngineArgs.from_cli_args(args)
    model_config = engine_args.create_model_config()
    model_config.quantization = None  # as vLLM's render server: no weights are loaded here
    vllm_config = VllmConfig(
        model_config=model_config,
        logging_config=engine_args.create_logging_config(),
        structured_outputs_config=engine_args.create_structured_outputs_config(),
        lora_config=LoRAConfig() if args.enable_lora else None,
    )
    renderer = renderer_from_config(vllm_config)
    return Frontend(
        args=args,
        vllm_config=vllm_config,
        renderer=renderer,
        input_processor=InputProcessor(vllm_config, renderer),
    )

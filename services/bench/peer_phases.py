"""The measured phases of ``pdserve bench peers`` and its report: each workload of
:mod:`services.bench.peer_load` run against one stack with the CPU of every process of the
stack read around it (:func:`run_workloads`), then the stacks side by side
(:func:`comparison`, :func:`table`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx

from services.bench.peer_load import (
    Outcome,
    Slo,
    Workload,
    chat_body,
    chats,
    completion_body,
    concurrency_sweep,
    figures,
    one_at_a_time,
    rate_sweep,
    send,
    window_s,
)
from services.bench.procs import cpu_seconds

PidLabels = Callable[[], dict[int, str]]
"""The live processes of a stack, each with its label (read again before every phase)."""


def cpu_by_label(labels: Mapping[int, str]) -> dict[str, float]:
    """CPU seconds used so far by each label's processes together."""
    totals: dict[str, float] = {}
    for pid, label in labels.items():
        totals[label] = totals.get(label, 0.0) + cpu_seconds([pid])
    return totals


def cpu_figures(
    before: Mapping[str, float], after: Mapping[str, float], completed: int
) -> dict[str, Any]:
    """CPU of the whole stack and of each process label over a phase, per completed request
    (milliseconds; None when none completed)."""
    used = {label: after.get(label, 0.0) - before.get(label, 0.0) for label in after}
    total = sum(used.values())
    per = (lambda seconds: round(seconds * 1000 / completed, 2)) if completed else None
    return {
        "cpu_s": round(total, 3),
        "cpu_ms_per_request": per(total) if per else None,
        "cpu_ms_per_request_by_process": {
            label: per(seconds) for label, seconds in sorted(used.items())
        }
        if per
        else None,
    }


async def _phase(
    pids: PidLabels, work: Callable[[], Awaitable[list[Outcome]]], slo: Slo
) -> tuple[dict[str, Any], list[Outcome]]:
    labels = pids()
    before = cpu_by_label(labels)
    outcomes = await work()
    after = cpu_by_label(labels)
    summary = figures(outcomes, window_s(outcomes), slo)
    return {**summary, **cpu_figures(before, after, summary["completed"])}, outcomes


async def run_workloads(
    url: str, pids: PidLabels, load: Workload, slo: Slo
) -> tuple[dict[str, dict[str, Any]], list[Outcome]]:
    """Every phase against the stack at ``url`` (after one unmeasured completion and chat:
    first connections, NIXL handshakes); the phases' figures and every request's outcome."""
    phases: dict[str, dict[str, Any]] = {}
    every: list[Outcome] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        for path, body in (
            ("/v1/completions", completion_body(load.model, "warm up", load.max_tokens)),
            (
                "/v1/chat/completions",
                chat_body(load.model, [{"role": "user", "content": "warm up"}], load.max_tokens),
            ),
        ):
            warm = await send(client, path, body, "warm-up", load.timeout_s)
            if not warm.ok:
                raise RuntimeError(f"the warm-up {path} failed: {warm.error}")

        async def measured(name: str, work: Callable[[], Awaitable[list[Outcome]]]) -> None:
            phases[name], outcomes = await _phase(pids, work, slo)
            every.extend(outcomes)

        for rate in load.rates:
            await measured(f"rate_{rate:g}", functools.partial(rate_sweep, client, load, rate))
        if load.conversations and load.turns:
            await measured("chats", functools.partial(chats, client, load))
        for concurrency in load.concurrency:
            await measured(
                f"concurrency_{concurrency}",
                functools.partial(concurrency_sweep, client, load, concurrency),
            )
        for tokens in load.streamed_tokens:
            await measured(
                f"tokens_{tokens}", functools.partial(one_at_a_time, client, load, tokens)
            )
    return phases, every


def per_extra_token(
    phases: Mapping[str, Mapping[str, Any]], tokens: Sequence[int]
) -> dict[str, Any]:
    """CPU ms that one more streamed token costs each process and the whole stack: the
    difference of the two ``tokens_<n>`` phases' CPU per request over their difference in
    tokens (empty without both)."""
    if len(tokens) != 2 or tokens[0] == tokens[1]:
        return {}
    low, high = (phases.get(f"tokens_{n}", {}) for n in tokens)
    if not low.get("cpu_ms_per_request") or not high.get("cpu_ms_per_request"):
        return {}
    extra = tokens[1] - tokens[0]
    by_low = low["cpu_ms_per_request_by_process"]
    by_high = high["cpu_ms_per_request_by_process"]
    return {
        "total": round((high["cpu_ms_per_request"] - low["cpu_ms_per_request"]) / extra, 3),
        "by_process": {
            label: round((by_high[label] - by_low.get(label, 0.0)) / extra, 3)
            for label in sorted(by_high)
        },
    }


# -- report -------------------------------------------------------------------------------

PEER = "peer"


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or not theirs or math.isnan(ours) or math.isnan(theirs):
        return None
    return round(ours / theirs, 3)


def _pick(phase: Mapping[str, Any], key: str) -> float | None:
    if "." in key:
        outer, inner = key.split(".")
        value = phase.get(outer, {}).get(inner)
    else:
        value = phase.get(key)
    return None if value is None else float(value)


COMPARED = (
    "cpu_ms_per_request",
    "ttft_ms.p50",
    "ttft_ms.p99",
    "itl_ms.p50",
    "itl_ms.p99",
    "second_token_ms.p50",
    "second_token_ms.p99",
    "later_itl_ms.p99",
    "e2e_ms.p50",
    "e2e_ms.p99",
    "goodput_rps",
    "throughput_rps",
)
"""Figures of each phase put side by side: each stack's over the ``peer``'s."""


def comparison(stacks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per stack other than the peer, per phase: each of :data:`COMPARED` over the peer's
    (below 1: lower than the peer's; for goodput and throughput, higher is better)."""
    peer = stacks.get(PEER, {})
    if "phases" not in peer:
        return {"note": "no peer figures to compare with"}
    result: dict[str, Any] = {}
    for name, stack in stacks.items():
        if name == PEER or "phases" not in stack:
            continue
        result[f"{name}_over_{PEER}"] = {
            phase: {
                key: _ratio(_pick(figures, key), _pick(peer["phases"].get(phase, {}), key))
                for key in COMPARED
            }
            for phase, figures in stack["phases"].items()
        }
    return result


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


_LATENCIES = ("ttft_ms", "itl_ms", "e2e_ms")


def table(stacks: Mapping[str, Mapping[str, Any]], agreement: Mapping[str, Any]) -> list[str]:
    """The figures as text lines: one row per stack and phase, then each stack's memory, KV
    transfers and output agreement."""
    head = (
        "stack", "phase", "done", "ttft p50", "ttft p99", "itl p50", "itl p99", "2nd p50",
        "2nd p99", "itl>2 p99", "e2e p50", "e2e p99", "req/s", "goodput", "cpu ms/req",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    notes: list[str] = []
    for name, stack in stacks.items():
        if "phases" not in stack:
            notes.append(f"{name}: not run: {str(stack.get('error', '?'))[:200]}")
            continue
        for phase, f in stack["phases"].items():
            rows.append(
                (
                    name, phase, f"{f['completed']}/{f['requests']}",
                    *(_cell(f[k][p]) for k in _LATENCIES[:2] for p in ("p50", "p99")),
                    _cell(f.get("second_token_ms", {}).get("p50")),
                    _cell(f.get("second_token_ms", {}).get("p99")),
                    _cell(f.get("later_itl_ms", {}).get("p99")),
                    *(_cell(f["e2e_ms"][p]) for p in ("p50", "p99")),
                    _cell(f["throughput_rps"]), _cell(f["goodput_rps"]),
                    _cell(f["cpu_ms_per_request"]),
                )
            )  # fmt: skip
        transfers = ", ".join(f"{k} {v:g}" for k, v in stack["kv_transfers"].items())
        notes.append(f"{name}: peak RSS {stack['peak_rss_mib']:.0f} MiB; KV {transfers}")
        token = stack.get("cpu_ms_per_extra_token") or {}
        if token:
            each = ", ".join(f"{k} {v:.3g}" for k, v in token["by_process"].items() if v > 0.005)
            notes.append(f"{name}: CPU ms per extra streamed token {token['total']:.3g} ({each})")
    for key, value in agreement.items():
        if isinstance(value, Mapping) and "compared" in value:
            notes.append(f"greedy outputs {key}: {value['equal']}/{value['compared']} equal")
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return [*lines, *notes]

"""``pdserve bench trace``'s figures: one setting's summary from its requests' results (cached
share beside the ceiling and the oracle, latencies, goodput, how placement spread and queued
requests), where the first token waited (the routers' phase histograms), the comparison across
settings and the plot (:mod:`services.bench.trace` runs the replays)."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.routing_figures import blind_to_the_cache
from services.bench.soak import percentiles_ms


@dataclass
class Sent:
    """One trace request's result."""

    index: int
    prompt_tokens: int
    reusable_tokens: int
    oracle_tokens: int = 0
    scheduled_s: float = 0.0
    lag_s: float = 0.0
    """How late it was sent against the trace's clock."""
    ok: bool = False
    cached_tokens: int = 0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prefill_engine: str | None = None
    decode_engine: str | None = None
    path: str | None = None
    error: str | None = None


def summarize(sent: list[Sent], args: argparse.Namespace, elapsed_s: float) -> dict[str, Any]:
    """A setting's figures (see the module docstring)."""
    done = [s for s in sent if s.ok]
    reusable = sum(s.reusable_tokens for s in done)
    oracle = sum(s.oracle_tokens for s in done)
    cached = sum(min(s.cached_tokens, s.prompt_tokens) for s in done)
    prompt = sum(s.prompt_tokens for s in done)
    ttft_slo, itl_slo = args.ttft_slo_ms / 1000, args.itl_slo_ms / 1000

    def met(s: Sent) -> bool:
        itl = sum(s.itls_s) / len(s.itls_s) if s.itls_s else 0.0
        return s.ttft_s is not None and s.ttft_s <= ttft_slo and itl <= itl_slo

    good = sum(met(s) for s in done)
    span_s = max((s.scheduled_s for s in sent), default=0.0) or elapsed_s
    errors = [s.error for s in sent if not s.ok]

    def share(part: int, whole: int) -> float | None:
        return round(part / whole, 4) if whole else None

    return {
        "requests": len(sent),
        "errors": len(errors),
        "first_errors": errors[:3],
        "problems": blind_to_the_cache(reusable, cached),
        "elapsed_s": round(elapsed_s, 2),
        "prompt_tokens": prompt,
        "reusable_tokens": reusable,
        "cached_tokens": cached,
        "oracle_tokens": oracle,
        "cached_share": share(cached, reusable),
        "oracle_share": share(oracle, reusable),
        "cached_share_of_oracle": share(cached, oracle),
        "local_runs": sum(s.path == "local" for s in done),
        "ttft_ms": percentiles_ms([s.ttft_s for s in done if s.ttft_s is not None]),
        "itl_ms": percentiles_ms([itl for s in done for itl in s.itls_s]),
        "goodput_per_s": round(good / span_s, 3) if span_s else None,
        "within_slo_share": share(good, len(sent)),
        "send_lag_ms": percentiles_ms([s.lag_s for s in sent]),
        "prefill_engines": len({s.prefill_engine for s in done if s.prefill_engine}),
        "requests_per_prefill_engine": _spread(s.prefill_engine for s in done),
        "requests_per_decode_engine": _spread(s.decode_engine for s in done),
        "local_runs_per_decode_engine": _spread(s.decode_engine for s in done if s.path == "local"),
        "ahead_on_arrival": _ahead_on_arrival(done),
    }


def _spread(engines: Iterable[str | None]) -> list[int]:
    """Requests per engine, most first (how evenly placement spread them)."""
    return sorted(Counter(engine for engine in engines if engine).values(), reverse=True)


def _ahead_on_arrival(done: Sequence[Sent]) -> dict[str, float | None]:
    """Queueing that placement chose, from the client's clock: for each request, how many
    others were already on its prefill engine (sent, no first token yet) and on its decode
    engine (sent, not finished) when it was sent; the mean, and the share of requests sent to
    a prefill engine that had one (a request's own engine only, whatever the others had)."""
    spans = [
        (
            s,
            s.scheduled_s + s.lag_s,
            s.scheduled_s + s.lag_s + (s.ttft_s or 0.0),
            s.scheduled_s + s.lag_s + (s.ttft_s or 0.0) + sum(s.itls_s),
        )
        for s in done
    ]
    prefill_ahead: list[int] = []
    decode_ahead: list[int] = []
    for sent, start, _, _ in spans:
        prefill_ahead.append(
            sum(
                1
                for other, begin, first, _ in spans
                if other is not sent
                and sent.prefill_engine
                and other.prefill_engine == sent.prefill_engine
                and begin <= start < first
            )
        )
        decode_ahead.append(
            sum(
                1
                for other, begin, _, end in spans
                if other is not sent
                and sent.decode_engine
                and other.decode_engine == sent.decode_engine
                and begin <= start < end
            )
        )
    if not spans:
        return {"prefill_mean": None, "prefill_busy_share": None, "decode_mean": None}
    return {
        "prefill_mean": round(sum(prefill_ahead) / len(spans), 3),
        "prefill_busy_share": round(sum(1 for n in prefill_ahead if n) / len(spans), 3),
        "decode_mean": round(sum(decode_ahead) / len(spans), 3),
    }


def ttft_phases(urls: list[str]) -> dict[str, tuple[float, float]]:
    """``phase -> (sum s, count)`` of the routers' ``pdserve_router_ttft_phase_seconds``:
    where a disaggregated request's first token waited (prefill, KV hand-off, the decode
    engine's first token)."""
    phases: dict[str, tuple[float, float]] = {}
    for url in urls:
        text = httpx.get(url, timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name != "pdserve_router_ttft_phase_seconds":
                continue
            for sample in family.samples:
                phase = sample.labels.get("phase", "")
                total, count = phases.get(phase, (0.0, 0.0))
                if sample.name.endswith("_sum"):
                    phases[phase] = (total + sample.value, count)
                elif sample.name.endswith("_count"):
                    phases[phase] = (total, count + sample.value)
    return phases


def phase_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    means: dict[str, float | None] = {}
    for phase, (total, count) in after.items():
        old_total, old_count = before.get(phase, (0.0, 0.0))
        done = count - old_count
        means[phase] = round((total - old_total) / done * 1000, 2) if done > 0 else None
    return means


def comparison(results: dict[str, Any]) -> dict[str, Any]:
    """Per fleet: each setting's cached share, its ratio to round-robin's and to the oracle's,
    and its TTFT p50 beside the approximate policy's."""
    rows: dict[str, Any] = {}
    for name, figures in results.items():
        fleet = name.partition("/")[2]
        if not fleet:
            continue
        base = results.get(f"round_robin/{fleet}", {})
        approximate = results.get(f"approximate/{fleet}", {})
        share, base_share = figures.get("cached_share"), base.get("cached_share")
        rows[name] = {
            "cached_share": share,
            "cached_share_of_oracle": figures.get("cached_share_of_oracle"),
            "over_round_robin": round(share / base_share, 2) if share and base_share else None,
            "ttft_p50_ms": figures["ttft_ms"]["p50"],
            "approximate_ttft_p50_ms": approximate.get("ttft_ms", {}).get("p50"),
        }
    return rows


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, (shares, ttfts) = plt.subplots(1, 2, figsize=(10, 4))
    by_policy: dict[str, list[tuple[int, Any]]] = {}
    for name, figures in results.items():
        policy = name.partition("/")[0]
        engines = figures.get("fleet", {}).get("prefill", 0)
        by_policy.setdefault(policy, []).append((engines, figures))
    for policy, points in sorted(by_policy.items()):
        points.sort(key=lambda point: point[0])
        xs = [x for x, _ in points]
        shares.plot(xs, [f["cached_share"] or 0 for _, f in points], marker="o", label=policy)
        ttfts.plot(xs, [f["ttft_ms"]["p50"] or 0 for _, f in points], marker="o", label=policy)
    oracle = sorted(by_policy.get(next(iter(by_policy), ""), []), key=lambda point: point[0])
    if oracle:
        xs = [x for x, _ in oracle]
        shares.plot(xs, [f["oracle_share"] or 0 for _, f in oracle], "k--", label="oracle")
    shares.set(xlabel="prefill engines", ylabel="cached share of reusable tokens", ylim=(0, 1.05))
    ttfts.set(xlabel="prefill engines", ylabel="TTFT p50 (ms)")
    shares.legend()
    ttfts.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

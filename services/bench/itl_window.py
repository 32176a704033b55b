"""The inter-token latency of a batch of concurrent streams, over the window where all decode.

Streams started together do not decode together at first: a prefill engine (or a colocated
engine's token budget) prefills their prompts over several steps, and in a disaggregated layout
each prompt's KV then moves to the decode engine, so the first streams decode at a small batch
while the last are still being prefilled, and they finish as early. A mean over each stream's
whole life is a mean over smaller batches than the one started (32 streams of 2,048-token
prompts and 32 tokens each decoded about 4 at a time). So each stream's token times are rebuilt
(sent + TTFT + the cumulative gaps) and the gaps are taken only in the window where every
stream decodes: from the latest *second* token (a stream's first token comes from the prefill,
in PD from another engine; from its second it is in the decode batch) to the earliest last
token. The caller makes the streams long enough for the window to hold enough gaps; when it
holds none, the window falls back to every stream's decoding span and the effective batch says
how many decoded in it, on average over time.

Sans-IO: timelines in, figures out (``services.bench.profile`` measures them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from services.bench.soak import Outcome

Timeline = Sequence[float]
"""One stream's token arrival times (seconds, any common origin), first token first."""


@dataclass(frozen=True)
class ItlWindow:
    """The gaps between tokens in a window, pooled over the streams."""

    ms: float
    """Mean gap between consecutive tokens in the window."""
    gaps: int
    """The fewest gaps any stream has in the window (the steps it spans)."""
    effective_batch: float
    """Streams decoding (between their second and last token), time-weighted over the window."""
    mean_generated: float
    """Mean tokens a stream had generated before a gap of the window: the step that ends the gap
    attends over the prompt and these."""
    all_decoding: bool
    """Whether the window is the one where every stream decodes (else: the fallback)."""


def token_times(outcome: Outcome) -> list[float]:
    """A stream's token arrival times, rebuilt from when it was sent, its TTFT and its gaps
    (empty without a first token)."""
    if outcome.sent_at is None or outcome.ttft_s is None:
        return []
    times = [outcome.sent_at + outcome.ttft_s]
    for gap in outcome.itls_s:
        times.append(times[-1] + gap)
    return times


def itl_window(timelines: Sequence[Timeline]) -> ItlWindow | None:
    """The ITL where every stream decodes (see the module docstring); ``None`` when no stream
    has a gap after its second token."""
    decoding = [list(times) for times in timelines if len(times) >= 3]
    if not decoding:
        return None
    start = max(times[1] for times in decoding)
    end = min(times[-1] for times in decoding)
    window = _gaps_in(decoding, start, end) if end > start else None
    if window is not None and window[0] > 0:
        return _figures(decoding, start, end, window, all_decoding=True)
    start = min(times[1] for times in decoding)
    end = max(times[-1] for times in decoding)
    fallback = _gaps_in(decoding, start, end)
    return _figures(decoding, start, end, fallback, all_decoding=False)


def _gaps_in(
    streams: list[list[float]], start: float, end: float
) -> tuple[int, list[tuple[int, float]]]:
    """The fewest gaps a stream has in ``[start, end]``, and every gap there as (tokens
    generated before it, seconds)."""
    slack = 1e-9
    gaps: list[tuple[int, float]] = []
    fewest: int | None = None
    for times in streams:
        inside = [
            (index, later - at)
            for index, (at, later) in enumerate(itertools.pairwise(times))
            if index >= 1 and at >= start - slack and later <= end + slack
        ]
        gaps.extend(inside)
        fewest = len(inside) if fewest is None else min(fewest, len(inside))
    return fewest or 0, gaps


def _figures(
    streams: list[list[float]],
    start: float,
    end: float,
    window: tuple[int, list[tuple[int, float]]],
    *,
    all_decoding: bool,
) -> ItlWindow | None:
    fewest, gaps = window
    if not gaps:
        return None
    span = end - start
    overlap = sum(max(0.0, min(end, times[-1]) - max(start, times[1])) for times in streams)
    return ItlWindow(
        ms=sum(seconds for _, seconds in gaps) / len(gaps) * 1000,
        gaps=fewest,
        effective_batch=overlap / span if span > 0 else float(len(streams)),
        mean_generated=sum(index + 1 for index, _ in gaps) / len(gaps),
        all_decoding=all_decoding,
    )

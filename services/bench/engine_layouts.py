"""``pdserve bench engine --layouts``: several prefill/decode layouts in one run (pure code).

``--layouts 1x1:1x1,2x1:2x1,2x1:1x2`` names each pair as ``prefill PPxTP : decode PPxTP``. The
homogeneous ``1x1:1x1`` pair is the baseline: it always runs first (added when missing), and each
layout's transfer time is reported as a ratio to the baseline's of the same run, on the same
machine under the same load. :func:`layout_rows` turns each layout's TTFT figures (from
:func:`services.bench.engine._ttft`) into one row of the report.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BASELINE = "1x1:1x1"
_PAIR = re.compile(r"^(\d+)x(\d+):(\d+)x(\d+)$")


@dataclass(frozen=True)
class Layouts:
    """One prefill/decode pair: ``(pp, tp)`` each."""

    prefill: tuple[int, int]
    decode: tuple[int, int]

    @property
    def name(self) -> str:
        (ppp, ptp), (dpp, dtp) = self.prefill, self.decode
        return f"{ppp}x{ptp}:{dpp}x{dtp}"

    def describe(self) -> dict[str, dict[str, int]]:
        return {
            "prefill": {"pp": self.prefill[0], "tp": self.prefill[1]},
            "decode": {"pp": self.decode[0], "tp": self.decode[1]},
        }


def parse_layouts(text: str) -> tuple[Layouts, ...]:
    """``--layouts``: comma-separated ``PxT:PxT`` pairs, the baseline first (added if absent).

    Raises :class:`argparse.ArgumentTypeError` (argparse prints it and exits 2) for a malformed
    or repeated pair or a size below 1.
    """
    pairs: list[Layouts] = []
    for item in (part.strip() for part in text.split(",")):
        match = _PAIR.match(item)
        if match is None:
            raise argparse.ArgumentTypeError(
                f"layout {item!r} is not PPxTP:PPxTP (prefill : decode), e.g. 2x1:1x2"
            )
        ppp, ptp, dpp, dtp = (int(group) for group in match.groups())
        if min(ppp, ptp, dpp, dtp) < 1:
            raise argparse.ArgumentTypeError(f"layout {item!r}: PP and TP must be >= 1")
        layouts = Layouts((ppp, ptp), (dpp, dtp))
        if layouts in pairs:
            raise argparse.ArgumentTypeError(f"layout {item!r} is listed twice")
        pairs.append(layouts)
    baseline = Layouts((1, 1), (1, 1))
    return (baseline, *(pair for pair in pairs if pair != baseline))


def _ratio(value: float, baseline: float) -> float | None:
    return round(value / baseline, 2) if baseline > 0 else None


def layout_rows(results: Sequence[tuple[Layouts, Mapping[str, object]]]) -> list[dict[str, object]]:
    """One report row per layout from its ``_ttft`` result, the baseline (first) included.

    ``read_s`` is the mean duration of one transfer (a vLLM NIXL READ or WRITE; the reference
    engine's pull time when transfers are not counted); ``transfer_s_per_request`` is the summed
    transfer time of a request (``read_s`` x transfers per request: the ranks' transfers run in
    parallel, so a request waits about ``read_s``); both are also given over the baseline's.
    """
    rows: list[dict[str, object]] = []
    base_read = base_request = 0.0
    for index, (layouts, ttft) in enumerate(results):
        disagg = ttft["disaggregated"]
        assert isinstance(disagg, dict)
        read_s = float(disagg["kv_transfer_s"])
        reads = disagg.get("transfers_per_request")
        per_request = read_s * float(reads) if reads is not None else read_s
        if index == 0:
            base_read, base_request = read_s, per_request
        row: dict[str, object] = {"layout": layouts.name, **layouts.describe()}
        row["read_s"] = round(read_s, 6)
        if reads is not None:
            row["reads_per_request"] = reads
            row["descriptors_per_read"] = disagg["descriptors_per_transfer"]
        row["transfer_s_per_request"] = round(per_request, 6)
        row["transfer_vs_baseline"] = _ratio(per_request, base_request)
        row["read_vs_baseline"] = _ratio(read_s, base_read)
        row["to_first_decode_token_s"] = disagg["to_first_decode_token_s"]
        row["kv_share"] = disagg["kv_share"]
        colocated = ttft["colocated"]
        assert isinstance(colocated, dict)
        row["colocated_first_token_s"] = colocated["first_token_s"]
        rows.append(row)
    return rows

"""Several routers read as one (``--router-discovery dns``).

Behind a Kubernetes headless Service the router's name resolves to every router pod. Each
interval the planner resolves it, reads each address's ``/metrics`` at the URL's port (or at each
of ``--router-metrics-port``: one port per worker process of ``pdserve router --workers``), and
:class:`RouterFleet` adds the routers up into one cumulative :class:`RouterSnapshot`, so the
planner's interval arithmetic (``observe.interval_between``) is the same for one router or many.

Counters are added as increases per router, as Prometheus's ``increase()`` does, never as raw
sums: a router seen for the first time contributes nothing that interval (its counters hold its
whole past), a router whose counters went down restarted and contributes what it counted since,
and a router that left (or did not answer) simply stops contributing. The fleet's total therefore
never goes down and no router's history lands in one interval. Ready engines are the largest any
router reports (every router watches the same control plane).

Engines' loads (``pdserve_router_engine_load``) are not added either: every router relays the
same engine's own reports, so each engine counts once, with the busiest figures any router
relays for it (:func:`merge_engine_loads`: the routers differ only by a heartbeat in flight).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass

from services.planner.errors import MetricsUnreadable
from services.planner.observe import EngineReport, RouterSnapshot

Address = str
"""An IPv4 or IPv6 address of one router pod, as ``getaddrinfo`` gives it."""
Resolver = Callable[[str, int], list[Address]]


def resolve_addresses(host: str, port: int) -> list[Address]:
    """Every address ``host`` resolves to (sorted, without duplicates);
    :class:`MetricsUnreadable` when it resolves to none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise MetricsUnreadable(f"router name {host!r} does not resolve: {exc}") from exc
    addresses = sorted({str(info[4][0]) for info in infos})
    if not addresses:
        raise MetricsUnreadable(f"router name {host!r} resolves to no address")
    return addresses


@dataclass(frozen=True)
class _Counters:
    requests: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: float = 0.0
    itl_sum_s: float = 0.0
    itl_count: float = 0.0
    prompt_tokens: float = 0.0
    prompt_count: float = 0.0
    generation_tokens: float = 0.0
    generation_count: float = 0.0

    @classmethod
    def of(cls, snapshot: RouterSnapshot) -> _Counters:
        prompt = snapshot.prompt_tokens or (0.0, 0.0)
        generation = snapshot.generation_tokens or (0.0, 0.0)
        return cls(
            snapshot.requests,
            snapshot.ttft_sum_s,
            snapshot.ttft_count,
            snapshot.itl_sum_s,
            snapshot.itl_count,
            *prompt,
            *generation,
        )

    def plus(self, other: _Counters) -> _Counters:
        return _Counters(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def minus(self, other: _Counters) -> _Counters:
        return _Counters(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def went_down_from(self, before: _Counters) -> bool:
        return (
            self.requests < before.requests
            or self.ttft_count < before.ttft_count
            or self.itl_count < before.itl_count
            or self.prompt_count < before.prompt_count
            or self.generation_count < before.generation_count
        )


class RouterFleet:
    """The running total of several routers' figures (one instance per planner)."""

    def __init__(self) -> None:
        self._last: dict[str, _Counters] = {}
        self._total = _Counters()

    def add(self, reads: Mapping[str, RouterSnapshot], at_s: float) -> RouterSnapshot:
        """The fleet's cumulative figures after one round of ``reads`` (a router's key, e.g. its
        ``address:port`` -> its snapshot now); routers absent from ``reads`` are forgotten."""
        increase = _Counters()
        for address, snapshot in reads.items():
            now = _Counters.of(snapshot)
            before = self._last.get(address)
            if before is None:
                continue  # first seen: its counters are its baseline
            increase = increase.plus(now if now.went_down_from(before) else now.minus(before))
        self._last = {address: _Counters.of(s) for address, s in reads.items()}
        self._total = self._total.plus(increase)
        total = self._total
        # Token figures only when every router has them (a mix would skew the means).
        tokens = bool(reads) and all(
            s.prompt_tokens is not None and s.generation_tokens is not None for s in reads.values()
        )
        return RouterSnapshot(
            at_s=at_s,
            requests=total.requests,
            ttft_sum_s=total.ttft_sum_s,
            ttft_count=total.ttft_count,
            itl_sum_s=total.itl_sum_s,
            itl_count=total.itl_count,
            ready_prefill=_largest(s.ready_prefill for s in reads.values()),
            ready_decode=_largest(s.ready_decode for s in reads.values()),
            prompt_tokens=(total.prompt_tokens, total.prompt_count) if tokens else None,
            generation_tokens=(total.generation_tokens, total.generation_count) if tokens else None,
            engine_loads=merge_engine_loads(s.engine_loads for s in reads.values()),
        )


def merge_engine_loads(
    views: Iterable[tuple[EngineReport, ...] | None],
) -> tuple[EngineReport, ...] | None:
    """One report per ``(engine, role)`` from several routers' ``views`` of the same engines:
    the largest queue, running count and capacity and the fewest free blocks any router
    relays (never their sum: it is one engine). ``None`` when no router relays any."""
    merged: dict[tuple[str, str], EngineReport] = {}
    relayed = False
    for view in views:
        if view is None:
            continue
        relayed = True
        for report in view:
            key = (report.engine, report.role)
            known = merged.get(key)
            merged[key] = report if known is None else _busiest(known, report)
    if not relayed:
        return None
    return tuple(merged[key] for key in sorted(merged))


def _busiest(a: EngineReport, b: EngineReport) -> EngineReport:
    return EngineReport(
        a.engine,
        a.role,
        queue_depth=max(a.queue_depth, b.queue_depth),
        running_requests=max(a.running_requests, b.running_requests),
        kv_blocks_free=min(a.kv_blocks_free, b.kv_blocks_free),
        kv_blocks_total=max(a.kv_blocks_total, b.kv_blocks_total),
    )


def read_fleet(
    fleet: RouterFleet,
    scheme: str,
    host: str,
    ports: Sequence[int],
    read: Callable[[str], RouterSnapshot],
    at_s: Callable[[], float],
    resolve: Resolver = resolve_addresses,
) -> tuple[RouterSnapshot, dict[str, str]]:
    """One round: resolve ``host``, ``read`` the ``/metrics`` URL of each address at each of
    ``ports`` (one router process each), add them up.

    Returns the fleet's snapshot and the routers that could not be read (``netloc`` -> why; they
    count as gone this round). :class:`MetricsUnreadable` when none could be read.
    """
    failures: dict[str, str] = {}
    reads: dict[str, RouterSnapshot] = {}
    for address in resolve(host, ports[0]):
        for port in ports:
            netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
            try:
                reads[netloc] = read(f"{scheme}://{netloc}/metrics")
            except MetricsUnreadable as exc:
                failures[netloc] = str(exc)
    if not reads:
        raise MetricsUnreadable(f"no router behind {host!r} could be read: {failures}")
    return fleet.add(reads, at_s()), failures


def _largest(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None

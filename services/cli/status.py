"""``pdserve status``: engines, roles, generations, leases and the (pp, tp) readiness grid.

With ``--router URL`` it also shows that router's view of each engine's health: the state of
its circuit breaker (``closed``, ``open``, ``half_open``; services/router/scheduling/health.py) and
how often it opened, read from the router's ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.config import ControlPlaneSettings
from services.control_plane import EngineInspection, RedisControlPlane
from services.control_plane.aggregation import rank_field


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--router",
        metavar="URL",
        help="also show this router's circuit-breaker state of each engine (its /metrics)",
    )


def run(args: argparse.Namespace, settings: ControlPlaneSettings) -> int:
    inspections = asyncio.run(_collect(settings))
    report = [describe(item) for item in inspections]
    if args.router:
        try:
            circuits = router_circuits(args.router)
        except httpx.HTTPError as exc:
            print(f"pdserve status: cannot read {args.router}/metrics: {exc}")
            return 2
        for entry in report:
            entry["circuit"] = circuits.get(entry["engine_id"], {"state": "unknown", "trips": 0})
    if args.json:
        print(json.dumps({"namespace": settings.namespace, "engines": report}, indent=2))
    else:
        print(render_table(report, settings.namespace))
    return 0


async def _collect(settings: ControlPlaneSettings) -> list[EngineInspection]:
    control_plane = RedisControlPlane(settings)
    try:
        inspections = []
        for view in await control_plane.list_engines():
            inspection = await control_plane.inspect(view.engine_id)
            if inspection is not None:
                inspections.append(inspection)
        return inspections
    finally:
        await control_plane.close()


def router_circuits(url: str) -> dict[str, dict[str, Any]]:
    """``{engine: {"state", "trips"}}`` from a router's /metrics (engines it sees READY)."""
    text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=10).raise_for_status().text
    circuits: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            engine = sample.labels.get("engine")
            if engine is None:
                continue
            if sample.name == "pdserve_router_engine_circuit_state" and sample.value == 1:
                circuits.setdefault(engine, {"trips": 0})["state"] = sample.labels["state"]
            elif sample.name == "pdserve_router_circuit_trips_total":
                circuits.setdefault(engine, {"state": "unknown"})["trips"] = int(sample.value)
    for circuit in circuits.values():
        circuit.setdefault("state", "unknown")
    return circuits


def describe(inspection: EngineInspection) -> dict[str, Any]:
    view, verdict = inspection.view, inspection.aggregation
    record, status, load = view.record, view.status, view.load
    entry: dict[str, Any] = {"engine_id": view.engine_id, "problems": list(view.problems)}
    if record is not None:
        entry.update(
            role=record.role.value,
            model=record.model,
            engine_kind=record.engine_kind,
            generation=record.generation,
            endpoint=record.endpoint,
            pp_size=record.shape.pp_size,
            tp_size=record.shape.tp_size,
            num_layers=record.shape.num_layers,
            num_kv_heads=record.shape.num_kv_heads,
            lease_ttl_s=record.lease_ttl_ms / 1000,
            registered_s_ago=round(time.time() - record.registered_at_ms / 1000, 1),
        )
    entry["state"] = view.state.value if view.state else "unknown"
    if status is not None:
        entry["status_problems"] = list(status.problems)
        if status.ready_latency_ms >= 0:
            entry["ready_latency_ms"] = status.ready_latency_ms
    if load is not None:
        entry["load"] = {
            "queue_depth": load.queue_depth,
            "running_requests": load.running_requests,
            "kv_blocks_free": load.kv_blocks_free,
            "kv_blocks_total": load.kv_blocks_total,
        }
    if record is not None and verdict is not None:
        problems_by_rank: dict[str, list[str]] = {}
        for problem in verdict.problems:
            if problem.reason == "missing_ranks":
                continue  # shown as "missing" below
            where = rank_field(*problem.rank) if problem.rank else "engine"
            problems_by_rank.setdefault(where, []).append(problem.reason)
        grid = {}
        for pp in range(record.shape.pp_size):
            for tp in range(record.shape.tp_size):
                name = rank_field(pp, tp)
                if name in problems_by_rank:
                    grid[name] = ",".join(problems_by_rank[name])
                else:
                    grid[name] = "ok" if (pp, tp) in verdict.records else "missing"
        entry["grid"] = grid
        entry["verdict"] = verdict.state.value
        entry["reasons"] = [str(p) for p in verdict.problems]
    return entry


def render_table(report: list[dict[str, Any]], namespace: str) -> str:
    """Human-readable form of the JSON report."""
    if not report:
        return f"no engines registered in namespace {namespace!r}"
    lines = [f"namespace {namespace!r}: {len(report)} engine(s)"]
    for entry in report:
        lines.append("")
        lines.append(
            f"{entry['engine_id']}  {entry.get('role', '?')}  {entry['state'].upper()}  "
            f"gen {entry.get('generation', '?')}  PP={entry.get('pp_size', '?')} "
            f"TP={entry.get('tp_size', '?')}  {entry.get('model', '')}  "
            f"{entry.get('endpoint', '')}  lease {entry.get('lease_ttl_s', '?')}s"
        )
        circuit = entry.get("circuit")
        if circuit is not None:
            lines.append(f"  router circuit {circuit['state']}, opened {circuit['trips']} time(s)")
        grid = entry.get("grid", {})
        for pp in range(entry.get("pp_size", 0)):
            cells = [
                f"tp{tp}:{grid.get(f'{pp}:{tp}', '?')}" for tp in range(entry.get("tp_size", 0))
            ]
            lines.append(f"  pp{pp}  " + "  ".join(cells))
        for reason in entry.get("reasons", []) + entry["problems"]:
            if not reason.startswith("missing_ranks"):
                lines.append(f"  ! {reason}")
        missing = [name for name, cell in grid.items() if cell == "missing"]
        if missing:
            lines.append(f"  waiting for ranks {', '.join(missing)}")
    return "\n".join(lines)

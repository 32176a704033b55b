"""``pdserve up --autoscale``: the planner's decisions, carried out on this machine.

Once the router is healthy, ``pdserve up`` starts ``pdserve planner`` as one more child (its
router URL, ``--metrics-port 0``, the sim engines' ``--sim-profile`` as its profile unless a
``--planner-arg=--profile=...`` says otherwise, then every ``--planner-arg``). Every
``--autoscale-poll-s`` :func:`autoscale` reads the planner's ``/metrics``: once the planner has
decided at least once (``pdserve_planner_decisions_total``), each pool is brought to
``pdserve_planner_desired_replicas{pool}``:

- **up**: the missing engines (the next free ``<role>-<n>`` names, the same flags as the
  others) are started together, each kept once READY: it registers, pre-warms its
  handshakes and joins the router's pool like any engine; ``endpoints.json`` is rewritten;
- **down**: the newest engine of the pool is released: SIGTERM, so its host drains (new
  requests refused, so the router places them elsewhere; those in flight finish; KV held for
  consumers released) and deregisters, within ``--scale-down-timeout-s``, after which what is
  left is killed (said on stderr).

Both pools are resized at once; a pool goes down one engine a poll, and the next poll sees
the result of the last change. The planner's own stabilization
bounds how often a pool goes down. A planner that exits (or whose figures cannot be read)
changes nothing: the pools keep the engines they have, and a line says so once.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.cli.up_supervise import KeptEngines
from services.supervision import ChildExited, ChildProcess

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerView:
    """What the planner publishes now: whether it has decided yet, and each pool's size."""

    decided: bool
    desired: dict[str, int]


def read_planner(text: str) -> PlannerView:
    """``pdserve planner``'s ``/metrics`` text -> :class:`PlannerView`."""
    desired: dict[str, int] = {}
    decisions = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_planner_desired_replicas":
                desired[sample.labels.get("pool", "")] = int(sample.value)
            elif sample.name == "pdserve_planner_decisions_total":
                decisions += sample.value
    return PlannerView(decided=decisions > 0, desired=desired)


def planner_argv_flags(sim_profile: str | None, planner_args: Sequence[str]) -> list[str]:
    """The planner's flags after its router URL: the sim engines' profile unless the user
    named one, then the user's."""
    named = any(arg == "--profile" or arg.startswith("--profile=") for arg in planner_args)
    profile = [f"--profile={sim_profile}"] if sim_profile and not named else []
    return [*profile, *planner_args]


async def autoscale(
    kept: KeptEngines,
    *,
    planner: ChildProcess,
    children: list[ChildProcess],
    new_engine: Callable[[str, int], ChildProcess],
    poll_s: float,
    scale_down_timeout_s: float,
) -> None:
    """Bring each pool to the planner's desired size until the run stops (see the module
    docstring). ``children`` is ``pdserve up``'s list (engines are added and removed there);
    ``new_engine(role, index)`` builds a child with the next name."""
    url = str((planner.announced or {}).get("metrics", ""))
    unreadable = False
    async with httpx.AsyncClient(timeout=10.0) as client:
        while not kept.stop.is_set():
            try:
                await asyncio.wait_for(kept.stop.wait(), poll_s)
                return
            except TimeoutError:
                pass
            if not planner.running:
                print(
                    f"pdserve up: autoscale: {planner.describe_exit()}; the pools keep "
                    "their engines",
                    file=sys.stderr,
                    flush=True,
                )
                return
            try:
                response = await client.get(url)
                response.raise_for_status()
                view = read_planner(response.text)
            except (httpx.HTTPError, ValueError) as exc:
                if not unreadable:
                    print(f"pdserve up: autoscale: holding, planner unreadable: {exc}", flush=True)
                unreadable = True
                continue
            unreadable = False
            if not view.decided:
                continue
            await asyncio.gather(
                *(
                    _resize(
                        kept, pool, view.desired[pool], children, new_engine, scale_down_timeout_s
                    )
                    for pool in POOLS
                    if pool in view.desired
                )
            )


async def _resize(
    kept: KeptEngines,
    pool: str,
    desired: int,
    children: list[ChildProcess],
    new_engine: Callable[[str, int], ChildProcess],
    scale_down_timeout_s: float,
) -> None:
    running = [child for child in children if child.role == pool]
    if desired > len(running):
        first = 1 + max((_index(child.name) for child in running), default=-1)
        engines = [new_engine(pool, first + n) for n in range(desired - len(running))]
        names = ", ".join(engine.name for engine in engines)
        print(f"pdserve up: autoscale: {pool} {len(running)} -> {desired} "
              f"(planner wants {desired}): starting {names}", flush=True)  # fmt: skip
        children.extend(engines)
        await asyncio.gather(*(_start(kept, engine, children) for engine in engines))
        kept.changed()
    elif desired < len(running) and len(running) > 1:
        engine = max(running, key=lambda child: _index(child.name))
        print(f"pdserve up: autoscale: {pool} {len(running)} -> {len(running) - 1} "
              f"(planner wants {desired}): draining {engine.name}", flush=True)  # fmt: skip
        clean = await kept.release(engine, scale_down_timeout_s)
        children.remove(engine)
        if not clean:
            print(
                f"pdserve up: autoscale: {engine.name} did not drain within "
                f"{scale_down_timeout_s}s; killed",
                file=sys.stderr,
                flush=True,
            )
        kept.changed()


async def _start(kept: KeptEngines, engine: ChildProcess, children: list[ChildProcess]) -> None:
    """Start ``engine`` and keep it once READY; one that does not get there is killed and
    dropped (said on stderr)."""
    await engine.start()
    try:
        await engine.wait_ready(kept.ready_timeout_s)
    except (ChildExited, TimeoutError) as exc:
        print(
            f"pdserve up: autoscale: {engine.name} did not become READY ({exc}); "
            f"see {engine.log_path}",
            file=sys.stderr,
            flush=True,
        )
        await engine.kill()
        children.remove(engine)
        return
    kept.keep(engine)


def _index(name: str) -> int:
    suffix = name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0

"""The request's walk through the router, measured (docs/benchmarks.md, "The router's request
walk"): ``python -m tests.unit.router.request_walk`` (``--n 2`` for a forked prompt).

One completion (not streamed, ``max_tokens=3``) on one prefill and one decode fake engine
(:mod:`tests.unit.router.fakes`: reference engines, so ``n > 1`` forks), through the real router
app in process, after one warm-up request. ``sys.setprofile`` records every call of a function
under ``services/router`` from the moment the front end's ``PdserveEngineClient.generate`` is
entered until the engine's Decode is called. The *spine* is the router functions on the stack
at the engine calls (Prefill, Decode); the *walk* is the spine's functions and the router
functions they call directly (a comprehension or generator expression counts as its function),
in the order they run. A *return* is the walk entering a file it had been in before, other than
the one it is in (the engine is not a router file). Printed: each stretch of the walk in one
file, then the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from services.control_plane.wire import EngineRole
from tests.unit.router.fakes import MODEL, FakeFactory, http, prepared

ROUTER = str(Path(__file__).resolve().parents[3] / "services" / "router") + "/"
FAKES = str(Path(__file__).resolve().parent / "fakes.py")
ENGINE_CALLS = ("prefill", "decode", "decode_once")


def _owner(frame: FrameType | None) -> FrameType | None:
    """The function a comprehension's frame belongs to."""
    while frame is not None and frame.f_code.co_name.startswith("<"):
        frame = frame.f_back
    return frame


def record(n: int) -> tuple[list[tuple[CodeType, CodeType | None]], set[CodeType]]:
    """Every router call of one request, with its caller, and the spine."""
    calls: list[tuple[CodeType, CodeType | None]] = []
    spine: set[CodeType] = set()
    state = {"on": False, "done": False}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or state["done"]:
            return
        if not state["on"]:
            if code.co_name != "generate" or not code.co_filename.endswith("engine_client.py"):
                return
            state["on"] = True
            spine.add(code)
        engine = code.co_filename == FAKES and code.co_name in ENGINE_CALLS
        if not (code.co_filename.startswith(ROUTER) or engine) or code.co_name.startswith("<"):
            return
        caller = _owner(frame.f_back)
        calls.append((code, caller.f_code if caller is not None else None))
        if engine:
            outer: FrameType | None = frame.f_back
            while outer is not None:
                owner = _owner(outer)
                if owner is not None and owner.f_code.co_filename.startswith(ROUTER):
                    spine.add(owner.f_code)
                outer = outer.f_back
            state["done"] = code.co_name != "prefill"

    async def run() -> None:
        factory = FakeFactory()
        rt = prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
        body = {"model": MODEL, "prompt": "hello there world", "max_tokens": 3}
        async with http(rt) as client:
            await client.post("/v1/completions", json=body)
            sys.setprofile(profile)
            try:
                reply = await client.post(
                    "/v1/completions", json={**body, "n": n, "temperature": 1.0}
                )
            finally:
                sys.setprofile(None)
            assert reply.status_code == 200, reply.text

    asyncio.run(run())
    return calls, spine


def walk(n: int = 1) -> tuple[list[tuple[str, list[str]]], int, int]:
    """The walk's stretches (file, functions), its distinct functions and its returns."""
    calls, spine = record(n)
    steps = [
        ("ENGINE" if code.co_filename == FAKES else code.co_filename[len(ROUTER) :], code)
        for code, caller in calls
        if code in spine or caller in spine
    ]
    stretches: list[tuple[str, list[str]]] = []
    for file, code in steps:
        if not stretches or stretches[-1][0] != file:
            stretches.append((file, []))
        if code.co_qualname not in stretches[-1][1]:
            stretches[-1][1].append(code.co_qualname)
    seen: set[str] = set()
    returns = 0
    for file, _ in stretches:
        returns += file in seen and file != "ENGINE"
        seen.add(file)
    return stretches, len({code for _, code in steps}), returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1, help="choices (2 or more fork)")
    stretches, functions, returns = walk(parser.parse_args().n)
    for file, names in stretches:
        print(f"  {file:34} {', '.join(names)}")
    files = {file for file, _ in stretches} - {"ENGINE"}
    print(f"{functions} functions in {len(files)} files, {returns} returns to a file it left")


if __name__ == "__main__":
    main()

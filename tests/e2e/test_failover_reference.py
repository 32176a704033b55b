"""Zero lost requests when one engine process dies: a real ``pdserve up`` stack (reference
engine, its own Redis) with two prefill and two decode engines, under a steady load of
concurrent streamed and non-streamed requests sent with the official ``openai`` client: greedy,
greedy with output penalties, seeded sampled, and seeded sampled with two choices (``n = 2``:
forked from one prefill and one transfer, each choice continuing alone when its engine fails)
(``SAMPLING``), each deterministic, so a request that continued on other engines must give an
unbroken run's text.

Each scenario starts from the whole stack, whatever ran before it (:func:`whole`: ``pdserve up``
restarts an engine a scenario killed, and the scenario waits for it), so they pass in any order,
and ``test_restart_reference``'s scenarios share the stack (``shared_stack``,
tests/e2e/conftest.py):

0. a fault-free run gives the reference texts (the stack's first run, made when it started) again;
1. decode-0's rank stopped (SIGSTOP) past the router's idle bound mid-stream: its requests move
   to decode-1 (migrations counted), none fails; once resumed, decode-0's circuit closes again
   after a probe and it serves; then prefill-0's rank stopped past the prefill deadline:
   its prefills are retried on prefill-1 and pulls waiting on it continue elsewhere;
2. decode-0's rank killed (SIGKILL) mid-stream: its streams continue on decode-1;
3. prefill-0's rank killed under load: prefills and pulls in flight are retried on prefill-1
   (counted by phase), none fails;
4. on a stack of its own with one decode engine (``--no-restart``): that engine's host killed,
   so the requests it had fail, and say so at once with the OpenAI error envelope (no hang), as
   do new ones.

For 1-3: zero failed client requests, every text equal to the fault-free run's for its prompt,
the surviving engines' block pools full afterwards. Nothing is timed against the wall clock:
every wait has a generous bound and every client call one (``REQUEST_BOUND_S``) whose hit fails
the test as a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import openai
import pytest

from services.engines.reference.tiny_model import make_tiny_model
from tests.e2e.conftest import FAULT_STACK
from tests.e2e.faults.probes import load_of, metric, rank_pids
from tests.e2e.up_system import UpSystem

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.destructive,
    pytest.mark.slow,
    pytest.mark.xdist_group(FAULT_STACK),
]

MODEL = "tiny-model"
REQUEST_BOUND_S = 120.0
"""Client-side bound of every request; hitting it is a hang and fails the test."""
IDLE_BOUND_S = 12.0
"""The stack's router bounds (``PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S``, ``..._PREFILL_...``)."""
STALL_S = IDLE_BOUND_S + 6
"""Scenario 1's stop: past the idle bound."""
WAIT_BOUND_S = 90.0
"""Bound of every wait for an event (a stream reaching an engine, pools refilling)."""
MAX_TOKENS = 32
PROMPTS = tuple(
    f"prompt {index}: " + "the quick brown fox jumps over the lazy dog " * (2 + index % 3)
    for index in range(8)
)
SAMPLING = (
    {"temperature": 0},
    {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 1.0},
    {"temperature": 1.0, "seed": 1234},
    {"temperature": 1.0, "seed": 4321, "n": 2},
)
"""Prompt ``i``'s sampling is ``SAMPLING[i % 4]``: a continuation must count the tokens before
it in the output penalties and continue the seeded random stream after their draws (each
choice of ``n = 2`` its own, seeded ``seed + i``)."""


@dataclass
class Outcome:
    prompt: int
    stream: bool
    text: str = ""
    error: str | None = None
    code: str | None = None
    """The OpenAI error envelope's ``code`` of a failed request."""
    decode_engine: str | None = None
    chunks: int = 0
    done: bool = False


@dataclass
class Load:
    """Closed-loop clients; ``outcomes`` holds every request, finished or in flight."""

    outcomes: list[Outcome] = field(default_factory=list)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]

    def wrong(self, reference: dict[int, str]) -> list[tuple[int, str, str]]:
        return [
            (o.prompt, o.text, reference[o.prompt])
            for o in self.outcomes
            if o.error is None and o.text != reference[o.prompt]
        ]


async def one_request(client: openai.AsyncOpenAI, outcome: Outcome) -> None:
    """One completion of its prompt (``SAMPLING``); records the text (its choices' texts
    joined by `` | ``) or the error, never raises."""
    sampling = SAMPLING[outcome.prompt % len(SAMPLING)]
    body = {
        "model": MODEL,
        "prompt": PROMPTS[outcome.prompt],
        "max_tokens": MAX_TOKENS,
        **sampling,
        "extra_body": {"ignore_eos": True, "repetition_penalty": 1.2},
    }
    n = int(sampling.get("n", 1))
    try:
        async with asyncio.timeout(REQUEST_BOUND_S):
            if outcome.stream:
                raw = await client.completions.with_raw_response.create(**body, stream=True)
                outcome.decode_engine = raw.headers.get("x-pdserve-decode-engine")
                texts: dict[int, str] = {}
                finish: dict[int, str | None] = {}
                async for event in raw.parse():
                    for choice in event.choices:
                        texts[choice.index] = texts.get(choice.index, "") + choice.text
                        outcome.chunks += 1
                        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
                outcome.text = " | ".join(texts[index] for index in sorted(texts))
                if finish != dict.fromkeys(range(n), "length"):
                    outcome.error = f"finish_reason {finish!r}"
            else:
                raw = await client.completions.with_raw_response.create(**body)
                outcome.decode_engine = raw.headers.get("x-pdserve-decode-engine")
                result = raw.parse()
                choices = sorted(result.choices, key=lambda choice: choice.index)
                outcome.text = " | ".join(choice.text for choice in choices)
                assert result.usage is not None
                if len(choices) != n or result.usage.completion_tokens != n * MAX_TOKENS:
                    outcome.error = f"usage {result.usage}"
    except TimeoutError:
        outcome.error = "client bound hit (a hang)"
    except openai.APIError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.code = exc.code
    outcome.done = True


@contextlib.asynccontextmanager
async def steady_load(url: str, workers: int = 4) -> AsyncIterator[Load]:
    """``workers`` clients cycling over the prompts (each sampling streamed and not), until
    the block exits; then every request in flight is awaited."""
    load = Load()
    stop = asyncio.Event()
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S
    )

    async def worker(index: int) -> None:
        count = 0
        while not stop.is_set():
            prompt = (index + count) % len(PROMPTS)
            # Streamed: the first half of the prompts, so each sampling is both.
            outcome = Outcome(prompt=prompt, stream=prompt < len(PROMPTS) // 2)
            load.outcomes.append(outcome)
            await one_request(client, outcome)
            count += 1

    tasks = [asyncio.create_task(worker(index)) for index in range(workers)]
    try:
        yield load
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 10)
        await client.close()


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` (it may read /metrics) until true, or fail naming ``what``."""
    deadline = asyncio.get_running_loop().time() + WAIT_BOUND_S
    while True:
        if predicate():
            return
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {WAIT_BOUND_S}s"
        await asyncio.sleep(0.1)


async def streaming_on(load: Load, engine: str, chunks: int = 3) -> None:
    """Until a stream on ``engine`` has received ``chunks`` chunks (so a fault is mid-stream)."""
    await wait_for(
        lambda: any(
            o.stream and o.decode_engine == engine and o.chunks >= chunks and not o.done
            for o in load.outcomes
        ),
        f"a stream on {engine}",
    )


async def finished_after(load: Load, count: int) -> None:
    """Until ``count`` more requests than now have finished."""
    target = sum(o.done for o in load.outcomes) + count
    await wait_for(lambda: sum(o.done for o in load.outcomes) >= target, "requests finishing")


@dataclass
class Stack:
    up: UpSystem
    reference: dict[int, str] = field(default_factory=dict)

    def engine(self, name: str) -> dict[str, str]:
        engine: dict[str, str] = self.up.endpoints["engines"][name]
        return engine

    def rank(self, name: str) -> int:
        ranks = rank_pids(int(self.engine(name)["pid"]))
        assert len(ranks) == 1, ranks
        return ranks[0]

    def router(self, name: str, **labels: str) -> float:
        return metric(f"{self.up.url}/metrics", name, **labels)

    def closed(self, engine: str) -> bool:
        """Whether the router's circuit on ``engine`` is closed (round-robin routing then sends
        it every other request)."""
        state = "pdserve_router_engine_circuit_state"
        return self.router(state, engine=engine, state="closed") == 1


ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1")
RESTART_BOUND_S = 240.0
"""Bound of a restart (a back-off, then the reference engine loading the tiny model)."""
ROUTER_ENV = {
    "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",  # every request disaggregated
    # Both prefill engines get requests (prefix-aware routing would keep each of the few
    # prompts on one engine, maybe all on the same one).
    "PDSERVE_ROUTER_POLICY": "round_robin",
    "PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S": str(IDLE_BOUND_S),
    "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": str(IDLE_BOUND_S),
    # A resumed engine is probed again within seconds, not after a minute.
    "PDSERVE_ROUTER_CIRCUIT_MAX_BACKOFF_S": "10",
}
"""The router's settings of every stack here (and of ``test_restart_reference``)."""


def started_stack(
    tmp_path_factory: pytest.TempPathFactory, name: str, *args: str
) -> Iterator[Stack]:
    """``pdserve up`` of the tiny model with ``args``, READY, with the fault-free run's texts
    (``Stack.reference``); stopped afterwards."""
    model_dir = tmp_path_factory.mktemp("model") / MODEL
    make_tiny_model(model_dir)
    up = UpSystem(
        tmp_path_factory.mktemp(name), "--model", str(model_dir), *args, env=ROUTER_ENV,
        scrub_env=True,
    )  # fmt: skip
    try:
        up.wait_ready()
        stack = Stack(up)
        stack.reference = asyncio.run(fault_free_texts(stack))
        yield stack
    finally:
        up.stop()


@pytest.fixture
async def stack(shared_stack: Stack) -> Stack:
    """The stack this module shares with ``test_restart_reference`` (``shared_stack``,
    tests/e2e/conftest.py: two prefill and two decode engines, a killed one restarted half a
    second later), whole (see :func:`whole`)."""
    await whole(shared_stack)
    return shared_stack


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def whole(stack: Stack) -> None:
    """Until every engine of ``ENGINES`` runs (one a scenario killed restarted by ``pdserve up``,
    which rewrites ``endpoints.json`` once the new process is READY), the router has all of them
    READY and every block pool is full; ``stack.up.endpoints`` then names the processes now
    running."""
    deadline = asyncio.get_running_loop().time() + RESTART_BOUND_S
    while True:
        current = stack.up.read_endpoints()
        running = all(alive(int(current["engines"][name]["pid"])) for name in ENGINES)
        ready = [
            stack.router("pdserve_router_ready_engines", role=r) for r in ("prefill", "decode")
        ]
        if running and ready == [2, 2]:
            break
        assert asyncio.get_running_loop().time() < deadline, (
            f"the stack not whole within {RESTART_BOUND_S}s: {current['engines']}, ready {ready}"
        )
        await asyncio.sleep(0.2)
    stack.up.endpoints = current
    await pools_full(stack, *ENGINES)


async def pools_full(stack: Stack, *names: str) -> None:
    for name in names:
        target = stack.engine(name)["grpc"]
        async with asyncio.timeout(WAIT_BOUND_S):
            while True:
                load = await load_of(target)
                if load.kv_blocks_free == load.kv_blocks_total and load.running_requests == 0:
                    break
                await asyncio.sleep(0.2)


def assert_lost_nothing(stack: Stack, load: Load) -> None:
    assert load.outcomes and all(o.done for o in load.outcomes)
    failed = load.failed()
    assert not failed, [(o.prompt, o.stream, o.decode_engine, o.error) for o in failed]
    wrong = load.wrong(stack.reference)
    assert not wrong, f"{len(wrong)} text(s) differ from the fault-free run: {wrong[:2]}"


@contextlib.contextmanager
def resumed_at_exit(pid: int) -> Iterator[None]:
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def fault_free_texts(stack: Stack) -> dict[int, str]:
    """Every prompt once streamed and once not, concurrently, with no fault: the text of each
    prompt (streamed and non-streamed must agree, the prompts must differ)."""
    client = openai.AsyncOpenAI(
        base_url=f"{stack.up.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S
    )
    outcomes = [Outcome(p, stream) for p in range(len(PROMPTS)) for stream in (True, False)]
    try:
        await asyncio.gather(*(one_request(client, o) for o in outcomes))
    finally:
        await client.close()
    assert not [o.error for o in outcomes if o.error]
    texts: dict[int, str] = {}
    for outcome in outcomes:
        texts.setdefault(outcome.prompt, outcome.text)
        assert outcome.text == texts[outcome.prompt], "streamed != non-streamed"
    assert len(set(texts.values())) > 1  # the prompts really differ
    return texts


async def test_0_a_fault_free_run_gives_the_reference_texts(stack: Stack) -> None:
    assert await fault_free_texts(stack) == stack.reference


async def test_1_a_decode_rank_stalled_past_the_idle_bound_migrates_its_requests(
    stack: Stack,
) -> None:
    rank = stack.rank("decode-0")
    before = stack.router("pdserve_router_migrations_total", reason="engine_timeout")
    with resumed_at_exit(rank):
        async with steady_load(stack.up.url) as load:
            await streaming_on(load, "decode-0")
            os.kill(rank, signal.SIGSTOP)
            await wait_for(
                lambda: (
                    stack.router("pdserve_router_migrations_total", reason="engine_timeout")
                    > before
                ),
                "a migration after the idle bound",
            )
            await asyncio.sleep(max(STALL_S - IDLE_BOUND_S, 0))  # the stop lasts past the bound
            os.kill(rank, signal.SIGCONT)
            # decode-0 comes back: a probe after its back-off closes its circuit again.
            await wait_for(
                lambda: (
                    stack.router(
                        "pdserve_router_engine_circuit_state",
                        engine="decode-0",
                        state="closed",
                    )
                    == 1
                    and any(o.decode_engine == "decode-0" and o.done for o in load.outcomes[-8:])
                ),
                "decode-0 serving again",
            )
            await finished_after(load, 4)
    assert_lost_nothing(stack, load)
    assert stack.router("pdserve_router_circuit_trips_total", engine="decode-0") >= 1
    await pools_full(stack, "prefill-0", "prefill-1", "decode-0", "decode-1")


async def test_1b_a_prefill_rank_stalled_past_the_deadline_loses_nothing(stack: Stack) -> None:
    """Prefills waiting on the stopped rank time out and run on prefill-1; pulls waiting on it
    go on from a new prefill elsewhere (the decode engine's first delta never came)."""
    rank = stack.rank("prefill-0")
    timeouts = "pdserve_router_engine_timeouts_total"
    before = stack.router(timeouts)
    with resumed_at_exit(rank):
        async with steady_load(stack.up.url) as load:
            await finished_after(load, 4)
            await wait_for(lambda: stack.closed("prefill-0"), "prefill-0 chosen again")
            os.kill(rank, signal.SIGSTOP)
            await wait_for(lambda: stack.router(timeouts) > before, "a timed-out engine call")
            await asyncio.sleep(max(STALL_S - IDLE_BOUND_S, 0))
            os.kill(rank, signal.SIGCONT)
            await finished_after(load, 8)
    assert_lost_nothing(stack, load)
    assert stack.router("pdserve_router_circuit_trips_total", engine="prefill-0") >= 1
    await pools_full(stack, "prefill-0", "prefill-1", "decode-0", "decode-1")


async def test_2_a_killed_decode_rank_migrates_its_streams(stack: Stack) -> None:
    before = stack.router("pdserve_router_migrations_total")
    async with steady_load(stack.up.url) as load:
        await streaming_on(load, "decode-0")
        os.kill(stack.rank("decode-0"), signal.SIGKILL)
        await finished_after(load, 12)
    assert_lost_nothing(stack, load)
    moved = [o for o in load.outcomes if o.decode_engine == "decode-0"]
    assert moved, "no request was on decode-0 when it died"
    assert stack.router("pdserve_router_migrations_total") > before
    await pools_full(stack, "prefill-0", "prefill-1", "decode-1")


async def test_3_a_killed_prefill_rank_is_retried_on_the_other_prefill_engine(
    stack: Stack,
) -> None:
    """The rank is stopped first and killed once the router has a request on prefill-0, so
    that the death always meets a request in flight (a prefill of the tiny model takes
    milliseconds: a kill at a random moment usually meets none, and the host's deregistration
    then leaves nothing to retry)."""

    def retries_by_the_death() -> float:
        # A retry after the prefill deadline (the stop outliving it under load) is not the
        # path under test: the rank's death fails the call with another code.
        return stack.router("pdserve_router_prefill_retries_total") - stack.router(
            "pdserve_router_prefill_retries_total", reason="engine_timeout"
        )

    before = retries_by_the_death()
    migrations_before = stack.router("pdserve_router_migrations_total")
    rank = stack.rank("prefill-0")
    with resumed_at_exit(rank):
        async with steady_load(stack.up.url, workers=6) as load:
            await finished_after(load, 4)
            await wait_for(lambda: stack.closed("prefill-0"), "prefill-0 chosen again")
            os.kill(rank, signal.SIGSTOP)
            await wait_for(
                lambda: stack.router("pdserve_router_engine_inflight", engine="prefill-0") >= 1,
                "a request on the stopped prefill-0",
            )
            os.kill(rank, signal.SIGKILL)
            await wait_for(lambda: retries_by_the_death() > before, "a prefill retry")
            await finished_after(load, 12)
    assert_lost_nothing(stack, load)
    assert stack.router("pdserve_router_migrations_total") == migrations_before
    await pools_full(stack, "prefill-1", "decode-1")


@pytest.fixture
def one_decode_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of its own (this test kills its only decode engine): one prefill, one decode
    engine, nothing restarted."""
    yield from started_stack(tmp_path_factory, "up-one-decode", "--no-restart")


async def test_4_with_one_decode_engine_left_its_death_is_an_explicit_error(
    one_decode_stack: Stack,
) -> None:
    """The only decode engine's host (its engine service) dies; none is left to migrate to."""
    stack = one_decode_stack
    async with steady_load(stack.up.url) as load:
        await streaming_on(load, "decode-0")
        os.kill(int(stack.engine("decode-0")["pid"]), signal.SIGKILL)
        await wait_for(lambda: len(load.failed()) >= 2, "requests failing")
    failed = load.failed()
    assert not [o for o in failed if "hang" in (o.error or "")], "a request hung"
    # The OpenAI envelope (the client parsed its code), before or after the first byte.
    assert all(o.code for o in failed), [(o.error, o.code) for o in failed]
    # No request before the fault was lost, and nothing wrong was ever returned.
    assert not load.wrong(stack.reference)

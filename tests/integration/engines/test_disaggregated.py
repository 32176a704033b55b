"""Prefill on PP=2 TP=1, decode on PP=1 TP=2: real NIXL pulls between real rank processes.

Also the request lifecycle on real engines: continuous batching, stop strings and ids,
max_tokens, abort, lease expiry, refused handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.errors import KVLeaseExpired, ProducerUnavailable
from services.engines.reference.backend import ReferenceBackend
from services.engines.requests import DecodeRequest, FinishReason, PrefillRequest, SamplingParams
from tests.integration.engines.conftest import PROMPTS, collect, running_engine, wait_until_free

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
LEASE_S = 3.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(
    module_cp_settings: ControlPlaneSettings, tiny_model_dir: Path
) -> AsyncIterator[tuple[ReferenceBackend, ReferenceBackend]]:
    async with (
        running_engine(
            module_cp_settings,
            tiny_model_dir,
            engine_id="prefill-pp2",
            role=EngineRole.PREFILL,
            pp=2,
            kv_lease_s=LEASE_S,
        ) as prefill,
        running_engine(
            module_cp_settings, tiny_model_dir, engine_id="decode-tp2", role=EngineRole.DECODE, tp=2
        ) as decode,
    ):
        yield prefill, decode


def prompt_ids(engine: ReferenceBackend, index: int = 0) -> list[int]:
    return engine.tokenizer.encode(PROMPTS[index])


async def test_disaggregated_equals_colocated_and_frees_both_sides(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    prefill, decode = engines
    prompt = prompt_ids(prefill)
    colocated, _ = await collect(decode, "colocated", prompt, GREEDY)

    result = await prefill.prefill(PrefillRequest("disagg", tuple(prompt), GREEDY))
    assert result.kv_handle is not None and result.finish_reason is None
    assert result.first_token_id == colocated[0]
    rest, deltas = await collect(
        decode,
        "disagg",
        prompt,
        GREEDY,
        kv_handle=result.kv_handle,
        first_token_id=result.first_token_id,
    )
    assert [result.first_token_id, *rest] == colocated
    # Text the prefill held back (an incomplete character) is released by the decode engine.
    assert result.text + "".join(d.text for d in deltas) == decode.detokenize(colocated)
    assert deltas[0].kv_transfer_s is not None and deltas[0].kv_transfer_s > 0
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == len(colocated)
    await wait_until_free(decode)
    await wait_until_free(prefill)  # every consumer rank notified: no waiting for the lease
    assert prefill.metrics is not None
    assert prefill.metrics.value("pdserve_reference_engine_held_kv_total", outcome="released") >= 1


async def test_seeded_sampling_and_text_are_the_same_disaggregated_as_colocated(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    prefill, decode = engines
    prompt = prompt_ids(prefill, 1)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    colocated, colocated_deltas = await collect(decode, "seeded-colocated", prompt, sampled)

    result = await prefill.prefill(PrefillRequest("seeded-disagg", tuple(prompt), sampled))
    assert result.kv_handle is not None
    rest, deltas = await collect(
        decode,
        "seeded-disagg",
        prompt,
        sampled,
        kv_handle=result.kv_handle,
        first_token_id=result.first_token_id,
    )
    # Output token i is drawn from (seed, i) wherever it is sampled, so the decode engine does
    # not reuse the draw the prefill engine spent on the first token.
    assert [result.first_token_id, *rest] == colocated
    assert result.text + "".join(d.text for d in deltas) == "".join(
        d.text for d in colocated_deltas
    )


async def test_requests_joining_a_running_batch_get_the_tokens_they_get_alone(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    _, decode = engines
    long = dataclasses.replace(GREEDY, max_tokens=30)
    alone_long, _ = await collect(decode, "alone-long", prompt_ids(decode, 0), long)
    alone_short, _ = await collect(decode, "alone-short", prompt_ids(decode, 1), GREEDY)

    stream = decode.decode(DecodeRequest("joined-long", tuple(prompt_ids(decode, 0)), long))
    first = await anext(stream)  # the long request is running now
    short_task = asyncio.create_task(collect(decode, "joined-short", prompt_ids(decode, 1), GREEDY))
    long_tokens = list(first.token_ids) + [t async for d in stream for t in d.token_ids]
    short_tokens, _ = await short_task
    assert long_tokens == alone_long
    assert short_tokens == alone_short


async def test_stop_string_stop_id_and_max_tokens(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    _, decode = engines
    prompt = prompt_ids(decode)
    tokens, deltas = await collect(
        decode, "free", prompt, dataclasses.replace(GREEDY, max_tokens=20)
    )
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 20

    stop = text[len(text) // 2 : len(text) // 2 + 3]
    _, stopped = await collect(
        decode, "stop-str", prompt, dataclasses.replace(GREEDY, max_tokens=20, stop=(stop,))
    )
    stopped_text = "".join(d.text for d in stopped)
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert stopped_text == text[: text.index(stop)]

    stop_id = tokens[4]
    by_id, last = await collect(
        decode,
        "stop-id",
        prompt,
        dataclasses.replace(GREEDY, max_tokens=20, stop_token_ids=(stop_id,)),
    )
    assert by_id == tokens[: tokens.index(stop_id)]  # the stop id is not returned
    assert last[-1].finish_reason is FinishReason.STOP
    await wait_until_free(decode)


async def test_abort_and_closing_a_stream_free_blocks(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    prefill, decode = engines
    long = dataclasses.replace(GREEDY, max_tokens=200)
    stream = decode.decode(DecodeRequest("to-abort", tuple(prompt_ids(decode)), long))
    await anext(stream)
    assert decode.load().kv_blocks_free < decode.load().kv_blocks_total
    assert await decode.abort("to-abort")
    rest = [d async for d in stream]
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert not await decode.abort("to-abort")
    await wait_until_free(decode)

    closed = decode.decode(DecodeRequest("to-close", tuple(prompt_ids(decode)), long))
    await anext(closed)
    await closed.aclose()
    await wait_until_free(decode)

    held = await prefill.prefill(PrefillRequest("held-abort", tuple(prompt_ids(prefill)), GREEDY))
    assert held.kv_handle is not None
    assert await prefill.abort("held-abort")
    await wait_until_free(prefill)
    assert prefill.metrics is not None
    assert prefill.metrics.value("pdserve_reference_engine_held_kv_total", outcome="aborted") == 1


async def test_lease_expiry_frees_held_blocks_and_refuses_the_handle(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    prefill, decode = engines
    prompt = prompt_ids(prefill)
    result = await prefill.prefill(PrefillRequest("expires", tuple(prompt), GREEDY))
    assert result.kv_handle is not None
    assert prefill.load().kv_blocks_free < prefill.load().kv_blocks_total
    await wait_until_free(prefill, timeout_s=LEASE_S + 10)
    assert prefill.metrics is not None
    assert prefill.metrics.value("pdserve_reference_engine_held_kv_total", outcome="expired") == 1
    assert time.time() >= result.kv_handle.lease_expires_at_s
    with pytest.raises(KVLeaseExpired):
        await collect(
            decode,
            "expires",
            prompt,
            GREEDY,
            kv_handle=result.kv_handle,
            first_token_id=result.first_token_id,
        )
    await wait_until_free(decode)


async def test_handle_of_another_generation_is_producer_unavailable(
    engines: tuple[ReferenceBackend, ReferenceBackend],
) -> None:
    prefill, decode = engines
    prompt = prompt_ids(prefill)
    result = await prefill.prefill(PrefillRequest("stale", tuple(prompt), GREEDY))
    assert result.kv_handle is not None
    stale = dataclasses.replace(result.kv_handle, generation=result.kv_handle.generation - 1)
    with pytest.raises(ProducerUnavailable):
        await collect(
            decode, "stale", prompt, GREEDY, kv_handle=stale, first_token_id=result.first_token_id
        )
    assert await prefill.abort("stale")
    assert decode.metrics is not None
    assert (
        decode.metrics.value(
            "pdserve_reference_engine_kv_errors_total",
            error="ProducerUnavailable",
            reason="stale_generation",
        )
        == 1
    )
    await wait_until_free(prefill)
    await wait_until_free(decode)

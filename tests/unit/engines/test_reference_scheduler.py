"""The reference engine's scheduler as a state machine: fake logits, no processes."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.engines.backend import FinishReason, PrefillResult, SamplingParams, TokenDelta
from services.engines.errors import EngineOverloaded, InvalidRequest
from services.engines.reference.messages import HoldKV, LeaseEnded, ReleaseKV
from services.engines.reference.metrics import ReferenceEngineMetrics
from services.engines.reference.scheduler import Scheduler, SchedulerLimits, SinkItem
from services.tokenization.tokenizer import ByteTokenizer

VOCAB = 300
RANKS = ((0, 0), (1, 0))


class ListSink:
    def __init__(self) -> None:
        self.items: list[SinkItem] = []

    def put(self, item: SinkItem) -> None:
        self.items.append(item)


def make(*, prefix_caching: bool = False, **limits: int) -> Scheduler:
    values = {
        "num_blocks": 16,
        "block_size": 4,
        "max_model_len": 64,
        "max_batch_tokens": 8,
        "max_running": 4,
        "max_queue": 2,
    }
    values.update(limits)
    return Scheduler(
        engine_id="e",
        generation=1,
        world_ranks=RANKS,
        limits=SchedulerLimits(
            **values,
            kv_lease_s=5.0,
            kv_pull_timeout_s=5.0,
            producer_connect_wait_s=1.0,
            prefix_caching=prefix_caching,
        ),
        tokenizer=ByteTokenizer(),
        eos_token_ids=frozenset(),
        metrics=ReferenceEngineMetrics("e", CollectorRegistry()),
    )


def logits_for(token: int, rows: int) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, token] = 1.0
    return logits


def run_step(scheduler: Scheduler, token: int = 65) -> int:
    step = scheduler.schedule()
    assert step is not None
    scheduler.complete_step(step, logits_for(token, len(step.entries)))
    scheduler.deliver_all()
    return sum(len(c.token_ids) for c in step.chunks)


def test_chunked_prefill_then_decode_and_blocks_come_back() -> None:
    scheduler = make()
    sink = ListSink()
    scheduler.submit("a", "generate", list(range(10)), SamplingParams(max_tokens=3), sink)
    assert run_step(scheduler) == 8  # the budget cuts the prompt
    assert sink.items == []
    assert run_step(scheduler) == 2  # rest of the prompt: first token sampled
    assert run_step(scheduler) == 1 and run_step(scheduler) == 1
    deltas = [item for item in sink.items if isinstance(item, TokenDelta)]
    assert [d.token_ids for d in deltas] == [(65,), (65,), (65,)]
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert scheduler.allocator.free_count == 16 and scheduler.in_flight == 0


def test_a_new_request_joins_the_running_batch_next_step() -> None:
    scheduler = make(max_batch_tokens=64)
    first, second = ListSink(), ListSink()
    scheduler.submit("a", "generate", [1, 2, 3], SamplingParams(max_tokens=5), first)
    run_step(scheduler)
    scheduler.submit("b", "generate", [4, 5, 6, 7], SamplingParams(max_tokens=5), second)
    step = scheduler.schedule()
    assert step is not None
    assert [len(c.token_ids) for c in step.chunks] == [1, 4]  # decode token first, then prefill


def test_queue_bound_overloads_and_oversized_requests_are_invalid() -> None:
    scheduler = make(max_running=1)
    scheduler.submit("a", "generate", [1], SamplingParams(), ListSink())
    scheduler.schedule()  # admits it
    for name in ("b", "c"):
        scheduler.submit(name, "generate", [1], SamplingParams(), ListSink())
    assert scheduler.schedule() is not None and scheduler.queue_depth == 2  # max_running
    with pytest.raises(EngineOverloaded):
        scheduler.submit("d", "generate", [1], SamplingParams(), ListSink())
    with pytest.raises(InvalidRequest):
        make(num_blocks=8).submit(
            "big", "generate", [1] * 40, SamplingParams(max_tokens=9), ListSink()
        )


def test_prefill_holds_blocks_until_every_rank_ends_its_lease() -> None:
    scheduler = make()
    sink = ListSink()
    scheduler.submit("p", "prefill", list(range(6)), SamplingParams(max_tokens=4), sink)
    run_step(scheduler)
    (result,) = sink.items
    assert isinstance(result, PrefillResult) and result.kv_handle is not None
    assert result.kv_handle.block_ids == (0, 1)
    assert scheduler.outbox == [HoldKV("p", (0, 1), 5.0)]
    assert scheduler.abort("p") and scheduler.outbox[-1] == ReleaseKV("p")
    scheduler.on_lease_ended(LeaseEnded((0, 0), "p", "aborted"))
    assert scheduler.allocator.free_count == 14  # one rank still reads
    scheduler.on_lease_ended(LeaseEnded((1, 0), "p", "aborted"))
    assert scheduler.allocator.free_count == 16 and scheduler.in_flight == 0


def run_to_end(scheduler: Scheduler, sink: ListSink) -> TokenDelta:
    while not any(isinstance(i, TokenDelta) and i.finish_reason for i in sink.items):
        run_step(scheduler)
    return next(i for i in sink.items if isinstance(i, TokenDelta) and i.finish_reason)


def test_prefix_cache_reuses_full_prompt_blocks_and_evicts_lru() -> None:
    scheduler = make(prefix_caching=True, max_batch_tokens=64)
    prompt = list(range(10))  # blocks of 4: two full blocks, then 2 tokens
    first = ListSink()
    scheduler.submit("a", "generate", prompt, SamplingParams(max_tokens=2), first)
    assert run_to_end(scheduler, first).usage.cached_tokens == 0  # type: ignore[union-attr]
    cache = scheduler.prefix_cache
    assert cache is not None and cache.num_cached == 2
    # Cached blocks nobody uses count as free.
    assert scheduler.free_blocks() == 16 and scheduler.allocator.free_count == 14
    again = ListSink()
    scheduler.submit("b", "generate", [*prompt, 99], SamplingParams(max_tokens=2), again)
    step = scheduler.schedule()
    assert step is not None and step.chunks[0].num_cached == 8  # only the 3 new tokens
    scheduler.complete_step(step, logits_for(65, 1))
    scheduler.deliver_all()
    assert run_to_end(scheduler, again).usage.cached_tokens == 8  # type: ignore[union-attr]
    # A prompt of exactly two blocks reuses one (its last token is always computed).
    exact = ListSink()
    scheduler.submit("c", "generate", prompt[:8], SamplingParams(max_tokens=1), exact)
    assert run_to_end(scheduler, exact).usage.cached_tokens == 4  # type: ignore[union-attr]
    # Filling the pool evicts the unused cached blocks instead of refusing.
    big = ListSink()
    scheduler.submit("d", "generate", list(range(100, 160)), SamplingParams(max_tokens=4), big)
    assert run_to_end(scheduler, big).finish_reason is FinishReason.LENGTH
    assert scheduler.in_flight == 0 and scheduler.free_blocks() == 16

"""The reference engine's scheduler as a state machine: fake logits, no processes."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.engines.errors import EngineOverloaded, InvalidRequest
from services.engines.reference.messages import HoldKV, LeaseEnded, PullDone, PullKV, ReleaseKV
from services.engines.reference.metrics import ReferenceEngineMetrics
from services.engines.reference.request_state import SchedulerLimits, SinkItem
from services.engines.reference.scheduler import Scheduler
from services.engines.requests import (
    FinishReason,
    Fork,
    KVHandle,
    PrefillResult,
    RequestLimits,
    SamplingParams,
    TokenDelta,
    Usage,
    validate_prompt,
)
from services.tokenization.tokenizer import ByteTokenizer

VOCAB = 300
RANKS = ((0, 0), (1, 0))


class ListSink:
    def __init__(self) -> None:
        self.items: list[SinkItem] = []

    def put(self, item: SinkItem) -> None:
        self.items.append(item)


def make(
    *, prefix_caching: bool = False, record_kv_events: bool = False, **limits: int
) -> Scheduler:
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
        record_kv_events=record_kv_events,
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
    assert scheduler.blocks.allocator.free_count == 16 and scheduler.in_flight == 0


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


@pytest.mark.parametrize("prompt", [[], [1] * 64], ids=["empty", "no-room"])
def test_intake_refuses_a_prompt_in_validate_prompts_words(prompt: list[int]) -> None:
    """One spelling of each prompt error: the intake's is the host's (validate_prompt)."""
    scheduler = make(max_model_len=64)
    with pytest.raises(InvalidRequest) as expected:
        validate_prompt(prompt, RequestLimits(vocab_size=VOCAB, max_model_len=64))
    with pytest.raises(InvalidRequest) as refused:
        scheduler.submit("a", "generate", prompt, SamplingParams(), ListSink())
    assert str(refused.value) == str(expected.value)
    assert scheduler.in_flight == 0 and scheduler.queue_depth == 0


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
    assert scheduler.blocks.allocator.free_count == 14  # one rank still reads
    scheduler.on_lease_ended(LeaseEnded((1, 0), "p", "aborted"))
    assert scheduler.blocks.allocator.free_count == 16 and scheduler.in_flight == 0


def run_to_end(scheduler: Scheduler, sink: ListSink) -> TokenDelta:
    while not any(isinstance(i, TokenDelta) and i.finish_reason for i in sink.items):
        run_step(scheduler)
    return next(i for i in sink.items if isinstance(i, TokenDelta) and i.finish_reason)


def test_prefix_cache_reuses_full_prompt_blocks_and_evicts_lru() -> None:
    scheduler = make(prefix_caching=True, max_batch_tokens=64)
    prompt = list(range(10))  # blocks of 4: two full blocks, then 2 tokens
    first = ListSink()
    scheduler.submit("a", "generate", prompt, SamplingParams(max_tokens=2), first)
    # Its two full blocks were computed and cached: 8 tokens written (vLLM's count).
    assert run_to_end(scheduler, first).usage == Usage(10, 2, 0, 8)
    cache = scheduler.blocks.prefix_cache
    assert cache is not None and cache.num_cached == 2
    # Cached blocks nobody uses count as free.
    assert scheduler.blocks.free_count() == 16 and scheduler.blocks.allocator.free_count == 14
    # A local request's first delta says what it found cached (streamed front ends answer
    # with it from their first chunk), once; the first request found nothing.
    assert [d.cached_tokens for d in first.items if isinstance(d, TokenDelta)] == [0, None]
    again = ListSink()
    scheduler.submit("b", "generate", [*prompt, 99], SamplingParams(max_tokens=2), again)
    step = scheduler.schedule()
    assert step is not None and step.chunks[0].num_cached == 8  # only the 3 new tokens
    scheduler.complete_step(step, logits_for(65, 1))
    scheduler.deliver_all()
    assert run_to_end(scheduler, again).usage == Usage(11, 2, 8, 0)  # nothing new to write
    assert [d.cached_tokens for d in again.items if isinstance(d, TokenDelta)] == [8, None]
    # A prompt of exactly two blocks reuses one (its last token is always computed).
    exact = ListSink()
    scheduler.submit("c", "generate", prompt[:8], SamplingParams(max_tokens=1), exact)
    # (its recomputed last block counts as written, as vLLM counts it: full blocks - cached)
    assert run_to_end(scheduler, exact).usage == Usage(8, 1, 4, 4)
    # Filling the pool evicts the unused cached blocks instead of refusing.
    big = ListSink()
    scheduler.submit("d", "generate", list(range(100, 160)), SamplingParams(max_tokens=4), big)
    assert run_to_end(scheduler, big).finish_reason is FinishReason.LENGTH
    assert scheduler.in_flight == 0 and scheduler.blocks.free_count() == 16


# -- n > 1: forks from one prefill and one pull ---------------------------------------------


def sampled_logits(rows: int) -> torch.Tensor:
    """Flat logits over 20 tokens: a sampled token depends on the generator only."""
    logits = torch.full((rows, VOCAB), -100.0)
    logits[:, 100:120] = 0.0
    return logits


def test_prefill_with_n_samples_each_choice_as_its_own_seeded_request() -> None:
    sampling = SamplingParams(max_tokens=4, temperature=1.0, seed=7, n=3)
    scheduler = make()
    sink = ListSink()
    scheduler.submit("p", "prefill", list(range(6)), sampling, sink)
    step = scheduler.schedule()
    assert step is not None
    scheduler.complete_step(step, sampled_logits(1))
    scheduler.deliver_all()
    (result,) = sink.items
    assert isinstance(result, PrefillResult) and result.kv_handle is not None
    firsts = [result.first_token_id, *(first.token_id for first in result.more_choices)]
    alone = []
    for choice in range(3):
        single, one = make(), ListSink()
        single.submit("q", "prefill", list(range(6)), sampling.for_choice(choice), one)
        step = single.schedule()
        assert step is not None
        single.complete_step(step, sampled_logits(1))
        single.deliver_all()
        assert isinstance(one.items[0], PrefillResult)
        alone.append(one.items[0].first_token_id)
    assert firsts == alone
    assert len(set(firsts)) > 1  # distinct seeds (20 equally likely tokens)


def handle_of(blocks: tuple[int, ...], tokens: int) -> KVHandle:
    return KVHandle("producer", 1, "p", blocks, tokens, time.time() + 60)


def test_forked_remote_decode_pulls_once_and_shares_the_prompts_full_blocks() -> None:
    scheduler = make(max_batch_tokens=64)
    sink = ListSink()
    prompt = list(range(6))  # one full block of 4, one partial
    forks = (Fork(0, 70), Fork(2, 71), Fork(5, 72))
    scheduler.submit(
        "d",
        "remote",
        prompt,
        SamplingParams(max_tokens=3),
        sink,
        handle=handle_of((7, 8), 6),
        first_token_id=70,
        forks=forks,
    )
    assert scheduler.schedule() is None  # pulling
    pulls = [c for c in scheduler.outbox if isinstance(c, PullKV)]
    assert len(pulls) == 1  # one transfer for three choices
    parent_blocks = list(pulls[0].local_block_ids)
    for rank in RANKS:
        scheduler.on_pull_done(PullDone(rank, "d", ok=True))
    shared = parent_blocks[0]
    assert scheduler.blocks.allocator.refcount(shared) == 3  # the parent's and two forks'
    step = scheduler.schedule()
    assert step is not None
    # The parent continues after its first token; each fork recomputes the partial block.
    assert sorted(len(c.token_ids) for c in step.chunks) == [1, 3, 3]
    assert all(c.block_table[0] == shared for c in step.chunks)
    scheduler.complete_step(step, logits_for(65, len(step.entries)))
    scheduler.deliver_all()
    while scheduler.in_flight:
        run_step(scheduler)
    deltas = [item for item in sink.items if isinstance(item, TokenDelta)]
    assert {d.choice for d in deltas} == {0, 2, 5}
    finished = [d for d in deltas if d.finish_reason is not None]
    assert sorted(d.choice for d in finished) == [0, 2, 5]
    assert all(d.usage is not None and d.usage.completion_tokens == 3 for d in finished)
    assert scheduler.blocks.allocator.free_count == 16


def test_aborting_a_forked_request_aborts_every_fork() -> None:
    scheduler = make(max_batch_tokens=64)
    sink = ListSink()
    scheduler.submit(
        "d",
        "remote",
        list(range(5)),
        SamplingParams(max_tokens=8),
        sink,
        handle=handle_of((7, 8), 5),
        first_token_id=70,
        forks=(Fork(0, 70), Fork(1, 71)),
    )
    scheduler.schedule()
    for rank in RANKS:
        scheduler.on_pull_done(PullDone(rank, "d", ok=True))
    run_step(scheduler)
    assert scheduler.abort("d")
    scheduler.deliver_all()
    aborted = [d for d in sink.items if isinstance(d, TokenDelta) and d.finish_reason]
    assert sorted(d.choice for d in aborted) == [0, 1]
    assert all(d.finish_reason is FinishReason.ABORT for d in aborted)
    assert scheduler.in_flight == 0 and scheduler.blocks.allocator.free_count == 16

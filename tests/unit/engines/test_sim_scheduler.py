"""The simulated engine's scheduler, driven step by step with no clock: admission by token
budget, sequences and KV blocks, the waiting queue, chunked prefill mixed with decodes (and the
longer steps it makes), preemption, and blocks freed at the end."""

from __future__ import annotations

import pytest

from services.engines.sim.profile import SimProfile, load_profile, parse_profile
from services.engines.sim.scheduler import SimScheduler, SimSequence

BLOCK = 16


def _profile(*, budget: int = 100, max_seqs: int = 8) -> SimProfile:
    data = load_profile().model_dump()
    data["prefill"] = {"base_ms": 2.0, "per_token_ms": 0.5, "per_token_squared_ms": 0.0}
    data["decode"] = {"base_ms": 3.0, "per_sequence_ms": 0.25, "per_context_token_ms": 0.01}
    data["scheduler"] = {"max_num_batched_tokens": budget, "max_num_seqs": max_seqs}
    return parse_profile(data)


def _scheduler(*, blocks: int = 1000, budget: int = 100, max_seqs: int = 8) -> SimScheduler:
    return SimScheduler(
        _profile(budget=budget, max_seqs=max_seqs), num_blocks=blocks, block_size=BLOCK
    )


def _local(request_id: str, prompt: int, max_new: int = 4) -> SimSequence:
    """A request that prefills here (colocated)."""
    return SimSequence(request_id, prompt, max_new_tokens=max_new)


def _remote(request_id: str, prompt: int, max_new: int = 4) -> SimSequence:
    """A request whose prompt's KV arrived from a prefill engine with its first token."""
    return SimSequence(request_id, prompt, max_new_tokens=max_new, generated=1, computed=prompt)


def _chunks(scheduler: SimScheduler) -> tuple[dict[str, int], float, list[str]]:
    """Plan and commit one step: tokens per request, duration, requests that got a token."""
    plan = scheduler.schedule()
    outcome = scheduler.commit(plan)
    tokens = {c.sequence.request_id: c.num_tokens for c in plan.chunks}
    return tokens, plan.duration_ms, [s.request_id for s in outcome.sampled]


def test_the_token_budget_chunks_prompts_and_admits_first_come_first_served() -> None:
    scheduler = _scheduler(budget=100)
    for name in ("a", "b", "c"):
        scheduler.add(_local(name, 80))
    tokens, duration, sampled = _chunks(scheduler)
    assert tokens == {"a": 80, "b": 20}  # c waits: no budget left
    assert sampled == ["a"]  # a's prompt is complete, b's is not
    assert duration == pytest.approx(2.0 + 0.5 * 100)
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    tokens, _, sampled = _chunks(scheduler)
    assert tokens == {"a": 1, "b": 60, "c": 39}  # running first: a's decode, b's last chunk
    assert sampled == ["a", "b"]


def test_kv_blocks_are_allocated_per_request_and_a_request_that_does_not_fit_waits() -> None:
    scheduler = _scheduler(blocks=10, budget=1000)
    scheduler.add(_local("a", 100, max_new=1))  # 7 blocks of 16
    scheduler.add(_local("b", 100, max_new=1))  # 7 more: only 3 left
    tokens, _, _ = _chunks(scheduler)
    assert tokens == {"a": 100}
    assert scheduler.free_blocks == 10  # a finished (one token) and freed its blocks
    # b waited at the head of the queue while a held the blocks; now it runs.
    tokens, _, sampled = _chunks(scheduler)
    assert list(tokens) == ["b"] and sampled == ["b"]
    assert scheduler.free_blocks == 10 and not scheduler.running and not scheduler.waiting


def test_the_head_of_the_queue_blocks_the_ones_behind_it() -> None:
    scheduler = _scheduler(blocks=12, budget=1000)
    scheduler.add(_local("big", 150, max_new=8))  # 10 blocks
    scheduler.add(_local("small", 10, max_new=1))  # 1 block, freed after its token
    _chunks(scheduler)
    assert scheduler.free_blocks == 2
    scheduler.add(_local("late", 100, max_new=1))  # 7 blocks: does not fit
    scheduler.add(_local("tiny", 5, max_new=1))  # would fit, but comes after late
    tokens, _, _ = _chunks(scheduler)
    assert tokens == {"big": 1}
    assert [s.request_id for s in scheduler.waiting] == ["late", "tiny"]
    assert scheduler.remove("big") is not None
    assert scheduler.free_blocks == 12
    tokens, _, _ = _chunks(scheduler)
    assert list(tokens) == ["late", "tiny"]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    scheduler = _scheduler(max_seqs=2)
    for name in ("a", "b", "c"):
        scheduler.add(_remote(name, 32, max_new=3))
    tokens, _, _ = _chunks(scheduler)
    assert set(tokens) == {"a", "b"}
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    _chunks(scheduler)  # a and b sample their third token and finish
    tokens, _, _ = _chunks(scheduler)
    assert list(tokens) == ["c"]


def test_a_prefill_chunk_in_a_decode_step_makes_the_step_longer() -> None:
    """Colocated: a new prompt's chunk rides in the same step as the running decodes, which
    all wait for it; in PD the decode engine's steps carry decode tokens only."""
    colocated = _scheduler(budget=64)
    disaggregated = _scheduler(budget=64)
    for scheduler in (colocated, disaggregated):
        for index in range(4):
            scheduler.add(_remote(f"d{index}", 100, max_new=50))
        _chunks(scheduler)  # the four are running
    _, pd_step, _ = _chunks(disaggregated)
    colocated.add(_local("new", 500, max_new=2))
    tokens, mixed_step, sampled = _chunks(colocated)
    assert tokens["new"] == 60  # the budget left after four decode tokens
    assert set(sampled) == {"d0", "d1", "d2", "d3"}
    decode_only = colocated.profile.decode_step_ms(4, 4 * 102)
    assert pd_step == pytest.approx(decode_only)
    assert mixed_step == pytest.approx(decode_only + 0.5 * 60)
    assert mixed_step > pd_step
    assert colocated.stats.mixed_steps == 1 and disaggregated.stats.mixed_steps == 0
    assert colocated.stats.longest_decode_step_ms == pytest.approx(mixed_step)


def test_blocks_grow_with_the_output_and_are_freed_at_the_end() -> None:
    scheduler = _scheduler(blocks=100)
    scheduler.add(_remote("a", 16, max_new=20))
    _chunks(scheduler)
    assert scheduler.free_blocks == 100 - 2  # 17 tokens: two blocks
    for _ in range(18):
        _chunks(scheduler)
    assert not scheduler.running and scheduler.free_blocks == 100
    assert "a" not in scheduler


def test_a_running_sequence_short_of_blocks_preempts_the_latest_admitted() -> None:
    scheduler = _scheduler(blocks=4)
    scheduler.add(_remote("old", 47, max_new=40))  # 48 tokens: 3 full blocks
    scheduler.add(_remote("new", 1, max_new=40))  # 2 tokens: 1 block
    _chunks(scheduler)
    assert scheduler.free_blocks == 0
    plan = scheduler.schedule()  # old's 49th token needs a fourth block
    assert plan.preempted == ("new",)
    assert [c.sequence.request_id for c in plan.chunks] == ["old"]
    # new is requeued first, its blocks freed, its KV to compute again (vLLM's recompute).
    assert [s.request_id for s in scheduler.waiting] == ["new"]
    assert scheduler.waiting[0].computed == 0 and scheduler.waiting[0].blocks == 0
    scheduler.commit(plan)
    assert scheduler.remove("old") is not None
    tokens, _, sampled = _chunks(scheduler)
    assert tokens == {"new": 3} and sampled == ["new"]  # prompt + the two tokens it had


def test_a_sequence_removed_mid_step_is_skipped_and_its_blocks_freed() -> None:
    scheduler = _scheduler(blocks=50)
    scheduler.add(_local("a", 40))
    plan = scheduler.schedule()
    assert scheduler.free_blocks == 50 - 3
    assert scheduler.remove("a") is not None
    outcome = scheduler.commit(plan)
    assert outcome.sampled == [] and scheduler.free_blocks == 50
    assert scheduler.clock_ms == pytest.approx(plan.duration_ms)

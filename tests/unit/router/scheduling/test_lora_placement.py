"""Placement by LoRA adapter (services/router/scheduling/adapters.py) and the router's served
names (services/router/frontend/served_names.py)."""

from __future__ import annotations

import dataclasses

import pytest

from services.control_plane.wire import EngineLoad, EngineRole
from services.engines.lora import LoRAAdapter
from services.router.errors import NoEngineAvailable
from services.router.frontend.served_names import ServedName, ServedNames
from services.router.frontend.vllm.lora import LoadReport, lora_refusal
from services.router.scheduling.policies import PromptInfo
from tests.unit.router.fakes import MODEL, runtime, sample, view

PREFILL, DECODE = EngineRole.PREFILL, EngineRole.DECODE
LOADS = "pdserve_router_lora_loads_total"


def lora_view(engine_id, role, *, slots=2, held=(), running=0):
    base = view(engine_id, role, load=EngineLoad(queue_depth=running, lora_adapters=held))
    record = dataclasses.replace(base.record, max_loras=slots, engine_kind="vllm")
    return dataclasses.replace(base, record=record)


def runtime_with(*views):
    rt = runtime(local_max_prompt_tokens=0)
    for v in views:
        rt.pool.update(v.engine_id, v)
    return rt


def prompt(lora_name=None):
    return PromptInfo(tuple(range(1, 40)), lora_name=lora_name)


def test_an_adapter_goes_to_the_engines_that_hold_it_even_when_busier():
    rt = runtime_with(
        lora_view("p0", PREFILL),
        lora_view("p1", PREFILL, held=("sql",), running=5),
        lora_view("d0", DECODE),
        lora_view("d1", DECODE, held=("sql",), running=5),
    )
    plan = rt.scheduler.plan(MODEL, prompt("sql"))
    assert (plan.prefill.engine_id, plan.decode.engine_id) == ("p1", "d1")
    assert sample(rt, LOADS, pool="prefill", outcome="ok") == 0
    assert sample(rt, LOADS, pool="decode", outcome="ok") == 0
    base = rt.scheduler.plan(MODEL, prompt())  # a base-model request: load alone decides
    assert (base.prefill.engine_id, base.decode.engine_id) == ("p0", "d0")


def test_an_adapter_no_engine_holds_is_placed_by_load_and_counted_as_a_load():
    rt = runtime_with(
        lora_view("p0", PREFILL, running=3),
        lora_view("p1", PREFILL),
        lora_view("d0", DECODE),
        lora_view("d1", DECODE, running=3),
    )
    plan = rt.scheduler.plan(MODEL, prompt("new"))
    assert (plan.prefill.engine_id, plan.decode.engine_id) == ("p1", "d0")
    assert sample(rt, LOADS, pool="prefill", outcome="ok") == 1
    assert sample(rt, LOADS, pool="decode", outcome="ok") == 1


def test_engines_without_lora_slots_never_get_an_adapter():
    rt = runtime_with(
        lora_view("p0", PREFILL, slots=0),
        lora_view("p1", PREFILL),
        lora_view("d0", DECODE, slots=0),
        lora_view("d1", DECODE),
    )
    for _ in range(3):
        plan = rt.scheduler.plan(MODEL, prompt("sql"))
        assert (plan.prefill.engine_id, plan.decode.engine_id) == ("p1", "d1")
    only_base = runtime_with(lora_view("p0", PREFILL, slots=0), lora_view("d0", DECODE, slots=0))
    with pytest.raises(NoEngineAvailable, match="serves LoRA adapters"):
        only_base.scheduler.plan(MODEL, prompt("sql"))
    assert only_base.scheduler.plan(MODEL, prompt()).decode.engine_id == "d0"


def test_the_approximate_cache_view_keys_prompts_by_adapter():
    tokens = tuple(range(1, 40))
    base, sql, chat = (
        PromptInfo(tokens, lora_name=n).block_hashes(4) for n in (None, "sql", "chat")
    )
    assert len(base) == len(sql) == len(chat) == 9
    assert not set(base) & set(sql) and not set(sql) & set(chat)
    assert PromptInfo(tokens, lora_name="sql").block_hashes(4) == sql


def test_served_names_resolve_bases_and_adapters_in_one_table():
    names = ServedNames()
    names.add_base("tiny", "tiny")
    assert names.resolve("tiny") == ServedName("tiny", "tiny")
    assert names.resolve(None) == names.resolve("") == ServedName("tiny", "tiny")
    sql = LoRAAdapter("sql", "/adapters/sql")
    assert names.add_adapter(sql) == ServedName("sql", "tiny", sql)
    assert names.resolve("sql") == ServedName("sql", "tiny", sql)
    assert names.resolve("other") is None
    with pytest.raises(ValueError, match="base model"):
        names.add_adapter(LoRAAdapter("tiny", "/x"))
    with pytest.raises(KeyError):
        names.add_adapter(LoRAAdapter("b", "/x"), parent="unknown")
    assert [s.name for s in names.adapters()] == ["sql"]
    assert names.remove_adapter("sql") == ServedName("sql", "tiny", sql)
    assert names.remove_adapter("sql") is None and names.remove_adapter("tiny") is None
    assert names.resolve("tiny") is not None


def test_a_load_refusal_names_the_engines_without_slots():
    records = [
        lora_view("ref-0", DECODE, slots=0).record,
        lora_view("ref-1", PREFILL, slots=0).record,
    ]
    records = [dataclasses.replace(r, engine_kind="reference") for r in records]
    message = lora_refusal(records, "sql")
    assert message is not None
    assert "ref-0 (reference engine)" in message and "ref-1 (reference engine)" in message
    assert lora_refusal([*records, lora_view("v", DECODE).record], "sql") is None
    assert lora_refusal([], "sql") is None


def test_a_partial_load_report_says_where_it_failed():
    report = LoadReport(
        "sql", ("p0", "d0"), (("d1", "LoRA rank 16 is greater than max_lora_rank 8."),)
    )
    assert report.partial
    assert "loaded on 2 of 3 engines (partial)" in report.message()
    assert "d1: LoRA rank 16 is greater than max_lora_rank 8." in report.message()
    assert not LoadReport("sql", ("p0",), ()).partial


def test_an_adapter_leaving_a_load_record_counts_as_an_eviction_unless_unloaded():
    """``pdserve_router_lora_evictions_total``: what left an engine's heartbeat load record
    without an unload through this router (its LRU made room); an unload is no eviction."""
    rt = runtime_with(lora_view("d0", DECODE, held=("a", "b", "c")))
    evictions = "pdserve_router_lora_evictions_total"
    rt.pool.update("d0", lora_view("d0", DECODE, held=("a", "b")))
    assert sample(rt, evictions, role="decode") == 1
    (slot,) = rt.pool.slots()
    slot.lora_unloads.add("b")  # as LoRAFanout.unload marks it before the engine drops it
    rt.pool.update("d0", lora_view("d0", DECODE, held=("a",)))
    assert sample(rt, evictions, role="decode") == 1
    assert slot.lora_unloads == set()
    rt.pool.update("d0", lora_view("d0", DECODE, held=("a", "d")))
    rt.pool.update("d0", lora_view("d0", DECODE, held=()))
    assert sample(rt, evictions, role="decode") == 3

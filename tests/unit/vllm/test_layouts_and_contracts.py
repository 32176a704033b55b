"""Pure parts of the vLLM engine: supported layouts, vLLM's layer split, the contracts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.engines.vllm.contracts import FinishedOnce, advance_grammar, decide_model_runner
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    UnsupportedVllmLayout,
    VllmLayout,
    check_local_layout,
    check_pair,
    vllm_layer_ranges,
)

PUSH, PULL = TransferMode.PUSH, TransferMode.PULL


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (VllmLayout(KVRole.BOTH, PUSH, pp_size=2), "pull mode"),
        (VllmLayout(KVRole.CONSUMER, PUSH, pp_size=2), "pull mode"),
        (VllmLayout(KVRole.PRODUCER, PUSH, dcp_size=2), "context parallelism"),
        (VllmLayout(KVRole.PRODUCER, PUSH, use_mla=True), "MLA"),
        (VllmLayout(KVRole.PRODUCER, PUSH, hybrid_kv_cache=True), "hybrid"),
    ],
)
def test_unsupported_local_layouts_name_what_works(layout: VllmLayout, match: str) -> None:
    with pytest.raises(UnsupportedVllmLayout, match=match):
        check_local_layout(layout)


@pytest.mark.parametrize(
    "layout",
    [
        VllmLayout(KVRole.PRODUCER, PUSH, pp_size=2, tp_size=2),
        VllmLayout(KVRole.PRODUCER, PUSH, pp_size=4),
        VllmLayout(KVRole.CONSUMER, PUSH, tp_size=4),
        VllmLayout(KVRole.PRODUCER, PULL, tp_size=2),
        VllmLayout(KVRole.CONSUMER, PULL, tp_size=8),
        VllmLayout(KVRole.PRODUCER, PULL, pp_size=2),
        VllmLayout(KVRole.CONSUMER, PULL, pp_size=3, tp_size=2),
        VllmLayout(KVRole.BOTH, PULL, pp_size=2),
    ],
)
def test_supported_local_layouts_pass(layout: VllmLayout) -> None:
    check_local_layout(layout)


def test_pairs_follow_vllms_tp_ratio_and_modes() -> None:
    prefill = VllmLayout(KVRole.PRODUCER, PUSH, pp_size=2, tp_size=2)
    check_pair(prefill, VllmLayout(KVRole.CONSUMER, PUSH, tp_size=4), num_kv_heads=8)
    check_pair(prefill, VllmLayout(KVRole.CONSUMER, PUSH, tp_size=1), num_kv_heads=8)
    with pytest.raises(UnsupportedVllmLayout, match="divide the other"):
        check_pair(prefill, VllmLayout(KVRole.CONSUMER, PUSH, tp_size=3), num_kv_heads=12)
    with pytest.raises(UnsupportedVllmLayout, match="push mode needs decode PP=1"):
        check_pair(prefill, VllmLayout(KVRole.CONSUMER, PUSH, pp_size=2), num_kv_heads=8)
    with pytest.raises(UnsupportedVllmLayout, match="same transfer mode"):
        check_pair(prefill, VllmLayout(KVRole.CONSUMER, PULL), num_kv_heads=8)
    with pytest.raises(UnsupportedVllmLayout, match="multiple"):
        check_pair(
            VllmLayout(KVRole.PRODUCER, PUSH, tp_size=3),
            VllmLayout(KVRole.CONSUMER, PUSH, tp_size=3),
            num_kv_heads=2,
        )


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (7, 2, [(0, 4), (4, 7)]),
        (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
        (8, 3, [(0, 3), (3, 6), (6, 8)]),
    ],
)
def test_layer_split_is_vllms_not_the_reference_engines(layers, pp, expected) -> None:
    # (10, 4) is where they differ: vLLM gives the extra layers to the stages before the last.
    assert [(r.start, r.stop) for r in vllm_layer_ranges(layers, pp)] == expected


def test_explicit_partition_is_validated() -> None:
    assert [len(r) for r in vllm_layer_ranges(7, 3, (3, 2, 2))] == [3, 2, 2]
    with pytest.raises(UnsupportedVllmLayout):
        vllm_layer_ranges(7, 3, (3, 3, 3))


def test_finished_once_passes_each_id_once_per_direction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    once = FinishedOnce(capacity=4)
    assert once.filter("send", ["a", "b", "a"]) == {"a", "b"}
    assert once.filter("send", ["a", "c"]) == {"c"}
    assert once.filter("recv", ["a"]) == {"a"}  # directions are independent
    assert once.duplicates == {"send": 2, "recv": 0}
    dropped = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(dropped) == 2 and all("finished-send" in m and "'a'" in m for m in dropped)


def test_model_runner_rule_is_precise() -> None:
    # A KVTransferConfig object alone (no connector name or role) is not an active connector.
    assert (
        decide_model_runner(
            kv_connector=None, kv_role=None, speculative=True, env_value=None
        ).use_v2
        is None
    )
    assert (
        decide_model_runner(
            kv_connector="PdservePushConnector", kv_role=None, speculative=True, env_value=None
        ).use_v2
        is None
    )
    no_spec = decide_model_runner(
        kv_connector="PdservePushConnector",
        kv_role="kv_producer",
        speculative=False,
        env_value=None,
    )
    assert no_spec.use_v2 is None
    forced = decide_model_runner(
        kv_connector="PdservePushConnector", kv_role="kv_producer", speculative=True, env_value=None
    )
    assert forced.use_v2 is False and "drafter" in forced.reason
    with pytest.raises(ValueError, match="V1 runner"):
        decide_model_runner(
            kv_connector="PdservePushConnector",
            kv_role="kv_producer",
            speculative=True,
            env_value="1",
        )


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [((2, 1), (1, 2)), ((2, 1), (2, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 1)), ((1, 2), (1, 1))],
)
def test_pull_mode_pairs_any_pp_and_tp(prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    check_pair(
        VllmLayout(KVRole.PRODUCER, PULL, *prefill),
        VllmLayout(KVRole.CONSUMER, PULL, *decode),
        num_kv_heads=2,
    )
    # TP must still fit the KV heads on each side.
    with pytest.raises(UnsupportedVllmLayout, match="divide the 4 KV heads"):
        check_pair(
            VllmLayout(KVRole.PRODUCER, PULL, *prefill),
            VllmLayout(KVRole.CONSUMER, PULL, 1, 3),
            num_kv_heads=4,
        )


class _Grammar:
    def __init__(self, accepts: bool) -> None:
        self.accepts = accepts
        self.fed: list[tuple[str, list[int]]] = []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.fed.append((request_id, tokens))
        return self.accepts


def _structured_request(grammar: _Grammar | None, extra: dict[str, object] | None) -> object:
    return SimpleNamespace(
        request_id="r1",
        sampling_params=SimpleNamespace(extra_args=extra),
        structured_output_request=SimpleNamespace(grammar=grammar),
    )


def test_advance_grammar_feeds_the_earlier_output_once() -> None:
    grammar = _Grammar(accepts=True)
    request = _structured_request(grammar, {"k": [5, 6], "other": 1})
    assert advance_grammar(request, "k")
    assert advance_grammar(request, "k")  # the key is gone: nothing fed twice
    assert grammar.fed == [("r1", [5, 6])]
    assert request.sampling_params.extra_args == {"other": 1}  # type: ignore[attr-defined]
    untouched = _Grammar(accepts=True)
    assert advance_grammar(_structured_request(untouched, None), "k")
    assert untouched.fed == []


def test_advance_grammar_reports_a_refusal_or_a_missing_grammar(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not advance_grammar(_structured_request(_Grammar(accepts=False), {"k": [9]}), "k")
    assert not advance_grammar(_structured_request(None, {"k": [9]}), "k")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and "refused" in errors[0] and "no compiled grammar" in errors[1]

"""The vLLM backend's pure helpers: CPU thread binding, the push-registration clip, the
detokenizer priming after a first token that ends mid-character, and the transfer exporter."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import DecodeRequest, KVHandle, SamplingParams
from services.engines.vllm.contracts import clip_to_producer
from services.engines.vllm.detokenizer import PrimedDecodeStream
from services.engines.vllm.platform import (
    THREADS_BIND_ENV,
    Platform,
    cpu_environment,
    cpu_thread_binding,
    omp_threads_per_rank,
    shared_cpu_bindings,
)
from services.engines.vllm.transfer_metrics import (
    KV_IN_PLACE_KEY,
    VllmTransferExporter,
    handoff_s,
)
from services.kv_transfer.metrics import KVTransferMetrics


def test_thread_binding_splits_cores_or_shares_them_round_robin() -> None:
    assert cpu_thread_binding(1, [0, 1]) == "0,1"
    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    # Engines sharing a machine: their own cores when there are enough, else one core per rank.
    assert shared_cpu_bindings([2, 1], [0, 1, 2, 3]) == ["0,1|2", "3"]
    assert shared_cpu_bindings([2, 1], [0, 1]) == ["0|1", "0"]
    assert shared_cpu_bindings([2, 2], [0, 1]) == ["0|1", "0|1"]
    assert shared_cpu_bindings([1], [0, 1]) == [cpu_thread_binding(1, [0, 1])]
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert cpu_thread_binding(3, [0, 1]) == "0|1|0"
    with pytest.raises(ValueError, match="world_size"):
        cpu_thread_binding(0, [0])


def test_an_operators_binding_wins() -> None:
    assert cpu_environment(2, {THREADS_BIND_ENV: "nobind"}) == {}
    assert THREADS_BIND_ENV in cpu_environment(2, {})


def test_a_forked_worker_gets_one_openmp_thread_per_core_of_its_rank() -> None:
    """vLLM sets OMP_NUM_THREADS only for workers it spawns: a forked one inherits it from
    the engine host's environment (2 threads spinning on one core cost 4x the CPU)."""
    assert cpu_environment(1, {THREADS_BIND_ENV: "1"}) == {"OMP_NUM_THREADS": "1"}
    assert cpu_environment(2, {THREADS_BIND_ENV: "0-3|4,5"})["OMP_NUM_THREADS"] == "2"
    assert cpu_environment(1, {THREADS_BIND_ENV: "0", "OMP_NUM_THREADS": "3"}) == {}
    derived = cpu_environment(1, {})
    cores = derived[THREADS_BIND_ENV].split(",")
    assert derived["OMP_NUM_THREADS"] == str(len(cores))
    assert omp_threads_per_rank("auto") is None
    assert omp_threads_per_rank("0|1|0") == 1


def test_consumer_blocks_past_the_producers_are_dropped_from_the_end() -> None:
    # A 33-token decode prompt at block size 32: two consumer blocks, one producer block.
    assert clip_to_producer(([7, 8],), [[1]], [2]) == ([7],)
    assert clip_to_producer([7, 8], [1], [2]) == [7]
    # One cached block on the consumer: its 3 uncached blocks stand for positions 1..3; the
    # producer's 3 blocks cover 0..2, so position 3 goes (vLLM aligns the rest from the end).
    assert clip_to_producer(([11, 12, 13],), [[0, 1, 2]], [4]) == ([11, 12],)
    assert clip_to_producer(([7, 8], [9, 10]), [[1, 2], [3]], [2, 2]) == ([7, 8], [9])
    assert clip_to_producer(([7],), [[1]], [1]) == ([7],)  # nothing to cut
    assert clip_to_producer((), [[1]], [1]) == ()  # a full prefix-cache hit moves nothing


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model = make_tiny_model(tmp_path_factory.mktemp("tok") / "m")
    return Tokenizer.from_file(str(Path(model) / "tokenizer.json"))


def test_a_prompt_ending_mid_character_does_not_leak_into_the_text(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The quick brown fox jumps").ids
    partial = next(
        t for t in range(tokenizer.get_vocab_size()) if "\ufffd" in tokenizer.decode([t])
    )
    following = tokenizer.encode(" gives").ids[-1]
    # What tokenizers' native priming returns (the bug), and the text after the prompt.
    native = DecodeStream(ids=[*prompt, partial], skip_special_tokens=True)
    assert "quick brown" in (native.step(tokenizer, following) or "")
    expected = tokenizer.decode([*prompt, partial, following])[len(tokenizer.decode(prompt)) :]
    primed = PrimedDecodeStream(ids=[*prompt, partial], skip_special_tokens=True)
    text = primed.step(tokenizer, following) or ""
    assert "quick brown" not in text
    assert expected.endswith(text) and text


def test_a_complete_prompt_keeps_the_native_priming(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hello, world! How are you").ids
    nxt = tokenizer.encode(" today").ids[-1]
    native = DecodeStream(ids=prompt, skip_special_tokens=True).step(tokenizer, nxt)
    assert PrimedDecodeStream(ids=prompt, skip_special_tokens=True).step(tokenizer, nxt) == native


def test_vllm_stats_become_pdserve_transfer_series() -> None:
    registry = CollectorRegistry()
    exporter = VllmTransferExporter(KVTransferMetrics(registry), "prefill-0", producer=True)
    expired = {"producer_engine": "prefill-0", "consumer_engine": "unknown", "producer_rank": "all"}
    # Exported at 0 before any expiry, so the first one is an increase the alert sees.
    assert registry.get_sample_value("pdserve_kv_transfer_expired_leases_total", expired) == 0
    exporter.record(None)
    exporter.record(
        {
            "transfer_duration": [0.002, 0.004],
            "post_duration": [0.0001, 0.0002],
            "bytes_transferred": [1024, 2048],
            "num_descriptors": [7, 7],
            "num_failed_transfers": [1],
            "num_kv_expired_reqs": [1, 1],
            "num_notifications_after_expiry": [1],
        }
    )
    pair = {
        "producer_engine": "prefill-0",
        "consumer_engine": "unknown",
        "producer_rank": "all",
        "consumer_rank": "all",
    }
    value = registry.get_sample_value
    assert value("pdserve_kv_transfer_latency_seconds_count", pair) == 2
    assert value("pdserve_kv_transfer_bytes_total", pair) == 3072
    assert value("pdserve_kv_transfer_descriptor_prep_seconds_count", pair) == 2
    assert (
        value("pdserve_kv_transfer_failures_total", {**pair, "reason": "vllm_transfer_failed"}) == 1
    )
    assert value("pdserve_kv_transfer_expired_leases_total", expired) == 2
    after_expiry = {**pair, "reason": "vllm_read_after_expiry"}
    assert value("pdserve_kv_transfer_failures_total", after_expiry) == 1
    assert exporter.transfers == 2
    assert exporter.transfer_seconds == pytest.approx(0.006)
    consumer = VllmTransferExporter(
        KVTransferMetrics(CollectorRegistry()), "decode-0", producer=False
    )
    assert consumer._pair()["consumer_engine"] == "decode-0"


def test_a_decodes_handoff_runs_from_its_arrival_to_its_kv_in_place_stamp() -> None:
    registry = CollectorRegistry()
    exporter = VllmTransferExporter(KVTransferMetrics(registry), "decode-0", producer=False)
    # vLLM's own ids: the caller's plus "-" and 8 random characters; msgpack sends lists.
    exporter.record({KV_IN_PLACE_KEY: [["chatcmpl-a-1-0a1b2c3d", 100.25], ["b-9f8e7d6c", 7.0]]})
    handle = KVHandle("prefill-0", 1, "chatcmpl-a-1", (0,), 8, 2e9)
    received = DecodeRequest("chatcmpl-a-1", (1, 2), SamplingParams(max_tokens=2), handle)
    assert handoff_s(exporter, received, arrived=100.0) == pytest.approx(0.25)
    assert handoff_s(exporter, received, arrived=100.0) is None  # once: no stale stamp later
    local = DecodeRequest("b", (1, 2), SamplingParams(max_tokens=2))
    assert handoff_s(exporter, local, arrived=1.0) is None  # no KV handle: no handoff
    assert exporter.take_in_place("b") == 7.0
    assert handoff_s(None, received, arrived=1.0) is None  # the engine not started
    assert exporter.transfers == 0  # a stamp is no transfer


def test_eager_on_a_cpu_with_pp_keeps_the_warm_up_that_allocates_stage_buffers() -> None:
    from vllm import config  # noqa: PLC0415  (make test installs the vllm extra)

    from services.engines.vllm.options import VllmEngineOptions, graph_args  # noqa: PLC0415

    def graph(platform: Platform, pp: int, eager: bool) -> dict[str, object]:
        options = VllmEngineOptions(Path("m"), pp_size=pp, enforce_eager=eager)
        return graph_args(options, platform, config)

    assert graph(Platform.CPU, 2, eager=False) == {} == graph(Platform.GPU, 2, eager=False)
    assert graph(Platform.CPU, 1, eager=True) == {"enforce_eager": True}
    assert graph(Platform.GPU, 2, eager=True) == {"enforce_eager": True}
    traced = graph(Platform.CPU, 2, eager=True)["compilation_config"]
    assert isinstance(traced, config.CompilationConfig)
    # Not CompilationMode.NONE: vLLM's CPU worker then runs the warm-up (profile) pass.
    assert traced.mode is config.CompilationMode.DYNAMO_TRACE_ONCE
    assert traced.backend == "eager"

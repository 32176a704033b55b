"""The vllm backend's parameter mapping and handle encoding (no vLLM engine needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import SecretStr

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane.wire import EngineRole
from services.engines import sampling_fields
from services.engines.backend import EngineRegistration
from services.engines.errors import UnknownKVHandle
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import SamplingParams
from services.engines.vllm.handshake import (
    ConnectorSettings,
    HandshakeResolutionError,
    VllmHandshakeExtra,
)
from services.engines.vllm.layouts import TransferMode, UnsupportedVllmLayout
from services.engines.vllm.options import (
    VllmEngineOptions,
    describe_model,
    kv_events_config,
    kv_transfer_config,
)
from services.engines.vllm.request_mapping import (
    OUTPUT_IN_PROMPT_ARG,
    SAMPLED_TOKENS_ARG,
    decode_handle,
    decode_sampling,
    encode_handle,
    prefill_sampling,
)
from tests.unit.sampling_examples import EVERY_FIELD_SET


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def registration(role: EngineRole = EngineRole.PREFILL) -> EngineRegistration:
    settings = ControlPlaneSettings(
        redis=RedisSettings(url="redis://10.0.0.1:6379/0", password=SecretStr("s3cret")),
        namespace="prod",
    )
    return EngineRegistration("pre-0", 42, role, settings)


PROMPT = (5, 6, 7, 8, 9)

PARAMS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "pre-0.g42",
    "remote_request_id": "r1",
    "remote_host": "pdserve-control-plane",
    "remote_port": 0,
    "tp_size": 2,
    "pp_size": 2,
}


def test_describe_reads_config_only(model_dir: Path) -> None:
    description = describe_model(VllmEngineOptions(model_dir, pp_size=2, tp_size=2))
    shape = description.shape
    assert (shape.num_layers, shape.num_kv_heads, shape.vocab_size) == (7, 2, 384)
    assert description.engine_kind == "vllm" and description.pp_aware


def test_kv_transfer_config_names_connector_generation_and_hides_password(model_dir: Path) -> None:
    config = kv_transfer_config(VllmEngineOptions(model_dir, pp_size=2), registration(), "h1")
    assert config["kv_connector"] == "PdservePushConnector"
    assert config["kv_connector_module_path"] == "services.engines.vllm.connector"
    assert (config["kv_role"], config["engine_id"]) == ("kv_producer", "pre-0.g42")
    assert "s3cret" not in repr(config)
    parsed = ConnectorSettings.from_extra_config(config["kv_connector_extra_config"])
    assert (parsed.engine_id, parsed.generation, parsed.compat_hash) == ("pre-0", 42, "h1")
    assert parsed.control_plane.namespace == "prod" and parsed.control_plane.redis.password is None


def test_kv_transfer_config_needs_pull_mode_for_pp_decode(model_dir: Path) -> None:
    with pytest.raises(UnsupportedVllmLayout, match="pull mode"):
        kv_transfer_config(
            VllmEngineOptions(model_dir, pp_size=2), registration(EngineRole.DECODE), "h1"
        )
    pull = VllmEngineOptions(model_dir, pp_size=2, transfer_mode=TransferMode.PULL)
    config = kv_transfer_config(pull, registration(EngineRole.DECODE), "h1")
    assert config["kv_role"] == "kv_consumer"
    assert kv_transfer_config(pull, registration(), "h1")["kv_role"] == "kv_producer"


def test_prefill_and_decode_sampling_carry_kv_transfer_params() -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.5, top_k=0, seed=3)
    prefill = prefill_sampling(sampling, PROMPT)
    assert prefill["max_tokens"] == 1 and prefill["top_k"] == -1
    assert prefill["extra_args"] == {"kv_transfer_params": {"do_remote_decode": True}}
    # One token ends at the prefill: vLLM must not hold its blocks for a consumer.
    assert "extra_args" not in prefill_sampling(SamplingParams(max_tokens=1), PROMPT)
    handle = encode_handle(
        PARAMS, engine_id="pre-0", generation=42, request_id="r1", num_tokens=40, lease_s=30
    )
    assert handle.block_ids == (3, 4, 5) and handle.request_id == "r1"
    decode = decode_sampling(sampling, PROMPT, handle, 11)
    params = decode["extra_args"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "pre-0.g42" and decode["max_tokens"] == 7
    assert "extra_args" not in decode_sampling(sampling, PROMPT, None)
    # Seeded: the decode's generator skips the producer's draw (services/engines/vllm/seeded_draws).
    assert decode["extra_args"][SAMPLED_TOKENS_ARG] == 1
    unseeded = SamplingParams(max_tokens=8, temperature=0.5)
    assert SAMPLED_TOKENS_ARG not in decode_sampling(unseeded, PROMPT, handle, 11)["extra_args"]
    # The producer's first token goes along when an output penalty needs it.
    assert OUTPUT_IN_PROMPT_ARG not in decode["extra_args"]
    penalized = SamplingParams(max_tokens=8, frequency_penalty=0.5)
    carried = decode_sampling(penalized, PROMPT, handle, 11)["extra_args"]
    assert carried[OUTPUT_IN_PROMPT_ARG] == [11]
    assert "extra_args" not in decode_sampling(penalized, PROMPT, None, 11)


def test_a_continuation_counts_its_prompts_output_in_penalties_and_draws() -> None:
    """The router's next leg of a broken request: the prompt's last tokens are output."""
    handle = encode_handle(
        PARAMS, engine_id="pre-0", generation=42, request_id="r1", num_tokens=40, lease_s=30
    )
    continued = SamplingParams(
        max_tokens=6, presence_penalty=0.5, temperature=1.0, seed=7, output_tokens_in_prompt=2
    )
    prefill = prefill_sampling(continued, PROMPT)["extra_args"]
    assert prefill[OUTPUT_IN_PROMPT_ARG] == list(PROMPT[-2:])
    assert prefill[SAMPLED_TOKENS_ARG] == 2
    remote = decode_sampling(continued, PROMPT, handle, 11)["extra_args"]
    assert remote[OUTPUT_IN_PROMPT_ARG] == [*PROMPT[-2:], 11]
    assert remote[SAMPLED_TOKENS_ARG] == 3
    local = decode_sampling(continued, PROMPT, None)["extra_args"]
    assert (local[OUTPUT_IN_PROMPT_ARG], local[SAMPLED_TOKENS_ARG]) == (list(PROMPT[-2:]), 2)
    # Greedy and unpenalized: nothing to carry.
    plain = SamplingParams(max_tokens=6, output_tokens_in_prompt=2)
    assert "extra_args" not in decode_sampling(plain, PROMPT, None)


def test_foreign_or_mismatched_handles_are_unknown() -> None:
    handle = encode_handle(
        PARAMS, engine_id="pre-0", generation=41, request_id="r1", num_tokens=4, lease_s=1
    )
    with pytest.raises(UnknownKVHandle, match=r"pre-0\.g41"):
        decode_handle(handle)
    with pytest.raises(UnknownKVHandle):
        decode_handle(handle.__class__("pre-0", 42, "r1", (), 1, 0.0, b"not json"))


def test_handshake_extra_round_trips_and_rejects_garbage() -> None:
    extra = VllmHandshakeExtra(b"payload", TransferMode.PUSH, 100.0, 1000.0)
    assert VllmHandshakeExtra.decode(extra.encode()) == extra
    # Remote perf 100 at wall 1000; we read at wall 1002 with perf 52: our perf then was 50.
    assert extra.clock_offset(now_perf=52.0, now_wall=1002.0) == pytest.approx(50.0)
    with pytest.raises(HandshakeResolutionError):
        VllmHandshakeExtra.decode(b"\x93\x01\x02")


def test_vllm_sampling_parameters_map_to_vllm_sampling_params() -> None:
    from vllm.sampling_params import SamplingParams as VllmSamplingParams  # noqa: PLC0415

    sampling = SamplingParams(
        max_tokens=8,
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=3,
        logit_bias=((5, 2.0), (9, -100.0)),
        logprobs=2,
        prompt_logprobs=1,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    prefill = VllmSamplingParams(**prefill_sampling(sampling, PROMPT))
    assert prefill.max_tokens == 1
    assert (prefill.presence_penalty, prefill.frequency_penalty) == (0.5, -0.25)
    # One token on the prefill: min_tokens is capped there (vLLM: min_tokens <= max_tokens).
    assert (prefill.repetition_penalty, prefill.min_p, prefill.min_tokens) == (1.2, 0.1, 1)
    assert prefill.logit_bias == {5: 2.0, 9: -100.0}
    assert (prefill.logprobs, prefill.prompt_logprobs) == (2, 1)
    assert prefill.include_stop_str_in_output
    assert not prefill.skip_special_tokens and not prefill.spaces_between_special_tokens
    handle = encode_handle(
        PARAMS, engine_id="pre-0", generation=42, request_id="r1", num_tokens=40, lease_s=30
    )
    local = VllmSamplingParams(**decode_sampling(sampling, PROMPT, None))
    assert (local.max_tokens, local.min_tokens, local.prompt_logprobs) == (8, 3, 1)
    remote = decode_sampling(sampling, PROMPT, handle, 11)
    # The producer made the first token (and the prompt's logprobs).
    assert (remote["max_tokens"], remote["min_tokens"], remote["prompt_logprobs"]) == (7, 2, None)
    neutral = VllmSamplingParams(**prefill_sampling(SamplingParams(), PROMPT))
    assert neutral.logit_bias is None and neutral.logprobs is None


def test_vllm_logprobs_map_to_token_logprobs() -> None:
    from vllm.logprobs import Logprob  # noqa: PLC0415

    from services.engines.vllm.logprobs import output_logprobs, prompt_logprobs_of  # noqa: PLC0415

    step = {7: Logprob(-2.5, 3, "x"), 1: Logprob(-0.5, 1, "a"), 2: Logprob(-1.0, 2, "b")}
    (entry,) = output_logprobs([7], [step], 2)
    assert (entry.token_id, entry.logprob, entry.rank) == (7, -2.5, 3)
    assert entry.top == ((1, -0.5), (2, -1.0))
    assert output_logprobs([7], [step], None) == ()
    prompt = prompt_logprobs_of([4, 7], [None, step], 0)
    assert [(e.token_id, e.top) for e in prompt] == [(7, ())]


def test_kv_events_config_is_vllms_zmq_publisher_with_replay_on_every_interface() -> None:
    from vllm.config import KVEventsConfig  # noqa: PLC0415

    config = KVEventsConfig(**kv_events_config(5557, 5558))
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")


def test_every_field_crosses_to_vllm_and_back_as_the_field_table_says() -> None:
    """pdserve -> vLLM (the engine) -> pdserve (the router's front end), every field set."""
    from vllm.sampling_params import SamplingParams as VllmSamplingParams  # noqa: PLC0415
    from vllm.sampling_params import StructuredOutputsParams  # noqa: PLC0415

    crossing = [name for name in sampling_fields.NAMES if sampling_fields.rule(name).in_vllm]
    assert set(crossing) <= set(VllmSamplingParams.__struct_fields__)  # vLLM spells them so
    sampling = EVERY_FIELD_SET
    assert all(
        getattr(sampling, name) != default for name, default in sampling_fields.DEFAULTS.items()
    )
    kwargs = sampling_fields.vllm_kwargs(sampling)
    kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    params = VllmSamplingParams(**kwargs)
    neutral = VllmSamplingParams()
    assert [name for name in crossing if getattr(params, name) == getattr(neutral, name)] == []
    # The detokenization options stay with the router; n and the continuation are pdserve's.
    expected = dataclasses.replace(
        sampling,
        skip_special_tokens=True,
        spaces_between_special_tokens=True,
        n=1,
        output_tokens_in_prompt=0,
    )
    assert sampling_fields.from_vllm(params) == expected
    # vLLM's own spellings: top_k -1 and a seed beyond 63 bits
    unbounded = VllmSamplingParams(top_k=-1, seed=2**64 + 5, logit_bias={"7": 300.0})
    back = sampling_fields.from_vllm(unbounded)
    assert (back.top_k, back.seed, back.logit_bias) == (0, 5, ((7, 100.0),))

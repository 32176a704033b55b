"""``pdserve prefill|decode`` settings, the engine registry and the ready line."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.cli.engine import build_settings, host_start_method
from services.cli.main import build_parser, main
from services.cli.settings import resolve
from services.engines.registry import (
    EngineOptions,
    EngineOptionsError,
    UnknownEngine,
    create_backend,
)
from services.engines.stub import StubBackend
from services.serving.host.config import split_host_port
from services.serving.ready import ServingEndpoints, parse_ready_line


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_DRAIN_TIMEOUT_S", "7")
    monkeypatch.setenv("PDSERVE_GRPC__LISTEN", "0.0.0.0:6000")
    args = build_parser().parse_args(
        [
            "decode",
            "--engine",
            "stub",
            "--listen",
            "127.0.0.1:0",
            "--metrics-port",
            "0",
            "--layer-partition",
            "3,2,2",
            "--namespace",
            "ns1",
        ]
    )
    settings = build_settings(args, resolve(args))
    assert settings.grpc.listen == "127.0.0.1:0"
    assert settings.drain_timeout_s == 7
    assert settings.metrics_port == 0
    assert settings.control_plane.namespace == "ns1"
    assert args.layer_partition == (3, 2, 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["prefill", "--engine", "reference"], "needs --model"),
        (["prefill", "--engine", "stub", "--listen", "nowhere"], "HOST:PORT"),
        (["decode", "--engine", "stub", "--engine-id", "bad id"], "engine id"),
        (["decode", "--engine", "stub", "--tls-key", "k.pem"], "go together"),
    ],
)
def test_bad_settings_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_registry_builds_the_stub_and_names_unknown_engines() -> None:
    backend = create_backend("stub", EngineOptions(pp_size=2, num_kv_blocks=10))
    assert isinstance(backend, StubBackend)
    assert backend.describe().shape.pp_size == 2
    assert backend.load().kv_blocks_total == 10
    with pytest.raises(UnknownEngine, match="choose one of"):
        create_backend("tensorrt", EngineOptions())


def test_ready_line_round_trips() -> None:
    endpoints = ServingEndpoints("decode-1", 17, "127.0.0.1:5000", None)
    payload = parse_ready_line(endpoints.ready_line())
    assert payload is not None
    assert ServingEndpoints.from_payload(payload) == endpoints
    assert parse_ready_line("some other output") is None


def test_split_host_port() -> None:
    assert split_host_port("[::1]:80") == ("[::1]", 80)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_host_port("host:99999")


def test_registry_builds_the_vllm_backend_from_service_flags(tmp_path) -> None:
    from services.engines.reference.tiny_model import make_tiny_model  # noqa: PLC0415
    from services.engines.vllm.backend import VllmBackend  # noqa: PLC0415

    model = make_tiny_model(tmp_path / "tiny")
    flags = EngineOptions(
        model_dir=model,
        pp_size=2,
        tp_size=1,
        block_size=16,
        transfer_mode="pull",
        kv_lease_s=7,
        enforce_eager=True,
        start_method="spawn",
        otlp_traces_endpoint="http://collector:4317",
    )
    backend = create_backend("vllm", flags)
    assert isinstance(backend, VllmBackend)
    assert backend.options.transfer_mode == "pull" and backend.options.kv_lease_s == 7
    assert backend.options.enforce_eager and backend.options.start_method == "spawn"
    assert build_parser().parse_args(["prefill", "--start-method", "fork"]).start_method == "fork"
    assert host_start_method("vllm", None) == "fork"  # the host forks unless told
    assert host_start_method("vllm", "spawn") == "spawn"
    assert host_start_method("reference", None) == "fork"  # its ranks too
    assert host_start_method("stub", None) is None and host_start_method("sim", None) is None
    # spawn: a backend asked to fork keeps this process's torch on one thread from then on
    reference = create_backend("reference", EngineOptions(model_dir=model, start_method="spawn"))
    assert reference.options.start_method == "spawn"  # type: ignore[attr-defined]
    with pytest.raises(EngineOptionsError, match="does not take --start-method"):
        create_backend("stub", EngineOptions(start_method="fork"))
    assert backend.options.otlp_traces_endpoint == "http://collector:4317"
    with pytest.raises(EngineOptionsError, match="does not take --otlp-traces-endpoint"):
        create_backend("stub", EngineOptions(otlp_traces_endpoint="http://collector:4317"))
    description = backend.describe()
    shape = description.shape
    assert (shape.pp_size, shape.tp_size, shape.block_size) == (2, 1, 16)
    assert description.engine_kind == "vllm"
    # The tiny model's KV block: K and V of every layer and KV head, float32 by default.
    config = json.loads((model / "config.json").read_text())
    head = config["head_dim"]
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    assert description.kv_block_bytes == 2 * layers * heads * 16 * head * 4
    reference_description = reference.describe()
    assert reference_description.kv_block_bytes == 2 * layers * heads * 16 * head * 4
    with pytest.raises(EngineOptionsError, match="VLLM_PP_LAYER_PARTITION"):
        create_backend("vllm", EngineOptions(model_dir=model, layer_partition=(3, 4)))


def test_kv_events_are_on_by_default_and_no_kv_events_turns_them_off(tmp_path) -> None:
    from services.engines.reference.backend import ReferenceBackend  # noqa: PLC0415
    from services.engines.reference.tiny_model import make_tiny_model  # noqa: PLC0415
    from services.engines.vllm.backend import VllmBackend  # noqa: PLC0415

    parser = build_parser()
    assert parser.parse_args(["decode"]).kv_events
    assert not parser.parse_args(["decode", "--no-kv-events"]).kv_events
    model = make_tiny_model(tmp_path / "tiny")
    vllm_on = create_backend("vllm", EngineOptions(model_dir=model))
    assert isinstance(vllm_on, VllmBackend)
    described = vllm_on.describe()
    events, replay = described.kv_events_endpoint, described.kv_events_replay_endpoint
    assert events.startswith("tcp://*:") and replay.startswith("tcp://*:") and events != replay
    assert vllm_on._kv_events is not None and vllm_on._kv_events["endpoint"] == events
    vllm_off = create_backend("vllm", EngineOptions(model_dir=model, kv_events=False))
    assert vllm_off.describe().kv_events_endpoint == ""
    reference = create_backend("reference", EngineOptions(model_dir=model))
    assert isinstance(reference, ReferenceBackend)
    try:
        described = reference.describe()
        publisher = reference.kv_event_publisher
        assert publisher is not None and described.kv_events_endpoint == publisher.endpoints.events
        assert reference.describe() == described  # bound once
    finally:
        asyncio.run(reference.stop())
    assert not reference.kv_event_publisher.publish([])  # type: ignore[union-attr]
    silent = create_backend("reference", EngineOptions(model_dir=model, kv_events=False))
    assert silent.describe().kv_events_replay_endpoint == ""

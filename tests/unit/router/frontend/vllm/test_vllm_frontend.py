"""vLLM's front end over the router's executor, in process: vLLM's app and serving classes, the
:class:`PdserveEngineClient` adapter, scripted engines (:mod:`tests.unit.router.fakes`).

What the adapter decides is checked here: vLLM's detokenizer makes the text from the engines'
token ids (a stop string found by it ends the run and aborts the engines), a failure before
the first token is an HTTP error even when streamed, ``n > 1`` forks on engines that fork,
the ``x-pdserve-*`` headers, and the one conversion of vLLM's sampling parameters. Real engines
and vLLM's own server are the e2e tests' (``test_vllm_frontend*.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer
from vllm import SamplingParams as VllmSamplingParams
from vllm.sampling_params import StructuredOutputsParams

from services.bench.sse import json_events
from services.cli.main import main as cli_main
from services.control_plane.wire import EngineRecord, EngineRole
from services.engines import sampling_fields
from services.engines.errors import EngineFailed
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import PrefillResult
from services.engines.trace_context import TraceContext
from services.engines.vllm.backend import _import_vllm
from services.engines.vllm.version_guard import (
    FRONTEND_SYMBOLS,
    VllmVersionMismatch,
    check_vllm,
    missing_symbols,
)
from services.router.errors import InvalidRequestError
from services.router.frontend.vllm.app import _leading_error
from services.router.frontend.vllm.config import frontend_args
from services.router.frontend.vllm.engine_client import (
    ROUTER_SIDE_SAMPLING,
    UNSUPPORTED_SAMPLING,
    engine_sampling,
)
from services.router.main import create_app
from services.router.runtime import RouterRuntime
from services.serving.client.connector import EngineConnector
from tests.unit.router.fakes import (
    FakeEngine,
    FakeFactory,
    post_then_hang_up,
    prepared,
    sample,
)

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("frontend") / "tiny-model")


FIRST_ID = 290
"""Decode token ``i`` has id ``FIRST_ID + i``: merged tokens of the tiny vocabulary, whole
characters each (ids below 256 are bytes, which vLLM's detokenizer holds back)."""


class WordFactory(FakeFactory):
    def connect(self, record: EngineRecord) -> EngineConnector:
        return self.engines.setdefault(
            record.engine_id, FakeEngine(record.engine_id, first_output_id=FIRST_ID)
        )


@pytest.fixture
def factory() -> FakeFactory:
    return WordFactory()


@contextlib.asynccontextmanager
async def served(rt: RouterRuntime) -> AsyncIterator[httpx.AsyncClient]:
    """The vLLM front-end app over ``rt``, its lifespan run (httpx's transport runs none)."""
    app = create_app(rt.settings, runtime=rt)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield client


def pd_runtime(factory: FakeFactory, model_dir: Path, **settings: object) -> RouterRuntime:
    return prepared(
        factory,
        ("p0", EngineRole.PREFILL),
        ("d0", EngineRole.DECODE),
        tokenizer=str(model_dir),
        served_model_name=MODEL,
        **settings,
    )


def decoded(model_dir: Path, ids: list[int]) -> str:
    return str(Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids))


async def test_text_is_vllms_detokenization_of_the_engines_tokens(
    factory: FakeFactory, model_dir: Path
) -> None:
    """The fake engines answer token 7, then FIRST_ID + 1, + 2...: the text is vLLM's decoding of
    those ids (not the engines' own text), with the run's engines in the headers."""
    rt = pd_runtime(factory, model_dir)
    level = logging.getLogger().level
    async with served(rt) as client:
        # (vLLM's app, built here, must not have raised the root logger's level: pdserve's
        # warnings would vanish)
        assert logging.getLogger().level == level
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0},
        )
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"] == decoded(model_dir, [7, FIRST_ID + 1, FIRST_ID + 2, FIRST_ID + 3])
    assert choice["finish_reason"] == "length"
    assert answer.headers["x-pdserve-prefill-engine"] == "p0"
    assert answer.headers["x-pdserve-decode-engine"] == "d0"
    assert answer.headers["x-pdserve-execution-path"] == "disaggregated"
    assert (
        sample(rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="ok") == 1
    )
    usage = answer.json()["usage"]
    prompt_sum = sample(rt, "pdserve_router_request_prompt_tokens_sum")
    assert prompt_sum == usage["prompt_tokens"] > 0
    assert sample(rt, "pdserve_router_request_generation_tokens_sum") == 4


async def test_responses_usage_reports_the_prefill_engines_cache_counts(
    factory: FakeFactory, model_dir: Path
) -> None:
    """``/v1/responses``' ``usage.input_tokens_details`` is vLLM's server's: the prompt tokens
    the prefill engine found cached (``cached_tokens``) and wrote to its prefix cache
    (``cache_write_tokens``, vLLM's ``num_cache_creation_tokens``), carried in the engine
    protocol's ``Usage``; plain and streamed (the ``response.completed`` event)."""
    factory.engines["p0"] = FakeEngine(
        "p0", first_output_id=FIRST_ID, cached_tokens=16, cache_write_tokens=32
    )
    rt = pd_runtime(factory, model_dir)
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": 4, "temperature": 0}
    async with served(rt) as client:
        answer = await client.post("/v1/responses", json=body)
        streamed = await client.post("/v1/responses", json={**body, "stream": True})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pdserve-prefill-engine"] == "p0"
    details = answer.json()["usage"]["input_tokens_details"]
    assert (details["cached_tokens"], details["cache_write_tokens"]) == (16, 32)
    assert streamed.status_code == 200, streamed.text
    events = json_events(streamed.text)
    (completed,) = [event for event in events if event["type"] == "response.completed"]
    details = completed["response"]["usage"]["input_tokens_details"]
    assert (details["cached_tokens"], details["cache_write_tokens"]) == (16, 32)


async def test_a_stop_string_found_by_vllms_detokenizer_ends_the_run(
    factory: FakeFactory, model_dir: Path
) -> None:
    rt = pd_runtime(factory, model_dir)
    whole = decoded(model_dir, [7, *range(FIRST_ID + 1, FIRST_ID + 6)])
    stop = decoded(model_dir, [FIRST_ID + 4])  # (" he": not in the fakes' own text)
    assert stop and stop in whole
    async with served(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hello there",
                "max_tokens": 6,
                "temperature": 0,
                "stop": [stop],
                "stream": True,
            },
        )
    events = json_events(answer.text)
    text = "".join(event["choices"][0]["text"] for event in events if event["choices"])
    assert text == whole[: whole.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop


async def test_a_stream_that_fails_before_its_first_token_is_an_http_error(
    factory: FakeFactory, model_dir: Path
) -> None:
    rt = pd_runtime(factory, model_dir, local_fallback=False, max_prefill_attempts=1)
    factory.connect(rt.pool.slots()[0].record)  # the fakes exist once connected
    for engine in factory.engines.values():
        engine.prefill_error = EngineFailed("the prefill engine broke")
    async with served(rt) as client:
        answer = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 4,
                "stream": True,
            },
        )
    assert answer.status_code >= 500, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert "the prefill engine broke" in answer.json()["error"]["message"]


async def test_prompt_logprobs_an_engine_did_not_send_are_no_crash(
    factory: FakeFactory, model_dir: Path
) -> None:
    """A one-token prompt has no prompt logprobs to carry (the fakes never send any)."""
    rt = pd_runtime(factory, model_dir)
    async with served(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": [7], "max_tokens": 2, "prompt_logprobs": 1},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"


async def test_n_choices_fork_on_engines_that_fork(factory: FakeFactory, model_dir: Path) -> None:
    rt = pd_runtime(factory, model_dir)
    async with served(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2, "temperature": 1.0},
        )
    assert answer.status_code == 200, answer.text
    assert sorted(c["index"] for c in answer.json()["choices"]) == [0, 1]
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 1


async def test_the_trace_context_vllm_extracts_reaches_the_engines(
    factory: FakeFactory, model_dir: Path
) -> None:
    """vLLM's serving classes hand ``generate`` the request's ``traceparent``/``tracestate``
    (``trace_headers``): checked (``frontend/trace_headers.py``), sent with every engine
    call of the request (chat and completions), an invalid one dropped and counted."""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rt = pd_runtime(factory, model_dir)
    async with served(rt) as client:
        for path, body in (
            ("/v1/completions", {"prompt": "hello there", "max_tokens": 3}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
            ),
        ):
            answer = await client.post(
                path,
                json={"model": MODEL, **body},
                headers={"traceparent": traceparent, "tracestate": "rojo=1"},
            )
            assert answer.status_code == 200, answer.text
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
            headers={"traceparent": "00-not-a-trace-01"},
        )
        assert answer.status_code == 200, answer.text
    trace = TraceContext(traceparent, "rojo=1")
    sent = [(call, t) for engine in factory.engines.values() for call, _, t in engine.traces]
    assert sorted(sent, key=str) == sorted(
        [("prefill", trace)] * 2 + [("decode", trace)] * 2 + [("prefill", None), ("decode", None)],
        key=str,
    )
    assert sample(rt, "pdserve_router_trace_context_dropped_total", header="traceparent") == 1


def test_sampling_has_one_spelling_and_nothing_is_dropped() -> None:
    params = VllmSamplingParams(
        temperature=0.5,
        top_k=-1,
        top_p=0.9,
        seed=-3,
        stop=["x"],
        stop_token_ids=[4],
        max_tokens=9,
        min_tokens=2,
        logit_bias={5: 250.0},
        logprobs=2,
        presence_penalty=0.5,
    )
    sampling = engine_sampling(params)
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.5, 0, 0.9)
    assert sampling.seed == (-3) & (2**63 - 1)  # as pdserve's unsigned seed
    assert (sampling.stop, sampling.stop_token_ids) == (("x",), (4,))
    assert (sampling.max_tokens, sampling.min_tokens, sampling.logprobs) == (9, 2, 2)
    assert sampling.logit_bias == ((5, 100.0),)
    assert sampling.presence_penalty == 0.5
    constrained = VllmSamplingParams(
        max_tokens=3, structured_outputs=StructuredOutputsParams(choice=["a", "b"])
    )
    assert json.loads(engine_sampling(constrained).structured_outputs) == {"choice": ["a", "b"]}
    with pytest.raises(InvalidRequestError) as refused:
        engine_sampling(VllmSamplingParams(max_tokens=3, bad_words=["x"]))
    assert refused.value.param == "bad_words"


REFUSED_VALUES: dict[str, Any] = {
    "bad_words": ["x"],
    "allowed_token_ids": [4],
    "thinking_token_budget": 5,
    "logprob_token_ids": [4],
    "prompt_logprob_token_ids": [4],
    "prompt_logprob_start": 1,
    "extra_args": {"mine": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "routed_experts_prompt_start": 2,
    "trace_decode_token_ids": [4],
}


def test_every_vllm_sampling_field_is_carried_applied_by_the_router_or_refused() -> None:
    carried = {name for name in sampling_fields.NAMES if sampling_fields.rule(name).in_vllm}
    refused = set(UNSUPPORTED_SAMPLING)
    classes = (carried, ROUTER_SIDE_SAMPLING, refused)
    for index, one in enumerate(classes):
        for other in classes[index + 1 :]:
            assert not one & other
    unclassified = set(VllmSamplingParams.__struct_fields__) - carried - ROUTER_SIDE_SAMPLING
    assert unclassified - refused == set()  # a new vLLM field: carry, apply or refuse it
    assert refused - set(VllmSamplingParams.__struct_fields__) == set()
    assert set(REFUSED_VALUES) == refused


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_sampling_field_the_engines_do_not_carry_is_refused_when_set(name: str) -> None:
    params = VllmSamplingParams(max_tokens=3)
    engine_sampling(params)  # vLLM's default: not a reason to refuse
    setattr(params, name, REFUSED_VALUES[name])
    with pytest.raises(InvalidRequestError) as refused:
        engine_sampling(params)
    assert refused.value.param == UNSUPPORTED_SAMPLING[name]
    assert UNSUPPORTED_SAMPLING[name] in refused.value.message


async def test_structured_outputs_on_reference_engines_are_a_400_naming_the_engine(
    factory: FakeFactory, model_dir: Path
) -> None:
    rt = pd_runtime(factory, model_dir)
    async with served(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 3,
                "structured_outputs": {"choice": ["yes", "no"]},
            },
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "reference engine" in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vllm_xargs", {"mine": 1}),
        ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}),
    ],
)
async def test_an_engine_side_field_pdserve_does_not_carry_is_a_400_naming_it(
    factory: FakeFactory, model_dir: Path, field: str, value: Any
) -> None:
    """vLLM's server accepts these; pdserve's engines would run without them: refused."""
    rt = pd_runtime(factory, model_dir)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, field: value}
    async with served(rt) as client:
        answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == field


def test_an_error_event_opening_a_stream_is_answered_as_an_error() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": []}
    event = b'data: {"error": {"message": "no engine", "type": "x", "code": 503}}\n\n'
    status, body = _leading_error(start, event) or (0, b"")
    assert status == 503
    assert json.loads(body)["error"]["message"] == "no engine"
    assert _leading_error(start, b'data: {"id": "cmpl-1"}\n\n') is None


def test_version_guard_names_every_missing_symbol(monkeypatch: pytest.MonkeyPatch) -> None:
    check_vllm(FRONTEND_SYMBOLS)  # the pinned vLLM has everything
    assert missing_symbols([("vllm.v1.engine.output_processor", "OutputProcessor.gone")]) == [
        "vllm.v1.engine.output_processor:OutputProcessor.gone"
    ]
    monkeypatch.setattr(
        "services.engines.vllm.version_guard.installed_vllm_version", lambda: "0.99.0"
    )
    with pytest.raises(
        VllmVersionMismatch, match=r"supports vLLM 0\.32\.0, found 0\.99\.0.*nope:x"
    ):
        check_vllm([("nope", "x")])


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--port=9000", "pdserve router --host/--port"),
        ("--ssl-keyfile=key.pem", "terminate TLS in front of it"),
        ("--uvicorn-log-level=debug", "PDSERVE_ROUTER_LOG_LEVEL"),
        ("--tensor-parallel-size=2", "configures vLLM's engine"),
        ("--max-num-seqs=4", "configures vLLM's engine"),
        ("--no-enable-prefix-caching", "configures vLLM's engine"),
        (
            '--kv-transfer-config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
            "configures vLLM's engine",
        ),
    ],
)
def test_a_vllm_server_flag_the_router_would_not_apply_is_refused_naming_where_it_goes(
    capsys: pytest.CaptureFixture[str], model_dir: Path, flag: str, says: str
) -> None:
    """``vllm serve`` takes it; the router would take it and do nothing with it: refused
    before anything starts, as vLLM refuses a bad flag (exit 2, the usage message)."""
    with pytest.raises(SystemExit) as exited:
        cli_main(["router", "--tokenizer", str(model_dir), f"--frontend-arg={flag}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert flag.split("=", 1)[0] in err and says in err, err


def test_the_front_end_flags_and_the_model_config_are_taken(model_dir: Path) -> None:
    args = frontend_args(
        model_dir,
        "tiny",
        [
            "--tool-call-parser=hermes",
            "--enable-auto-tool-choice",
            "--max-model-len=256",
            "--chat-template-content-format=openai",
            "--enable-prompt-tokens-details",
            "--reasoning-parser=deepseek_r1",
        ],
    )
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("hermes", True)
    assert (args.max_model_len, args.chat_template_content_format) == (256, "openai")
    assert args.enable_prompt_tokens_details and args.reasoning_parser == "deepseek_r1"


def test_router_and_engine_refuse_another_vllm_with_one_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], model_dir: Path
) -> None:
    monkeypatch.setattr(
        "services.engines.vllm.version_guard.installed_vllm_version", lambda: "0.31.0"
    )
    code = cli_main(["router", "--tokenizer", str(model_dir)])
    assert code == 2
    assert "supports vLLM 0.32.0, found 0.31.0" in capsys.readouterr().err
    with pytest.raises(EngineFailed, match=r"supports vLLM 0\.32\.0, found 0\.31\.0"):
        _import_vllm()


async def test_a_body_over_the_bound_is_413_on_every_post(
    factory: FakeFactory, model_dir: Path
) -> None:
    rt = pd_runtime(factory, model_dir, max_request_body_bytes=4096)
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1}

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(5):
            yield b"x" * 1024
        yield b'"}'

    async with served(rt) as client:
        replies = [
            await client.post("/v1/completions", json=big),
            await client.post("/tokenize", json=big),
            await client.post(
                "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            ),
        ]
        within = await client.post("/tokenize", json={"model": MODEL, "prompt": "x" * 3000})
    for reply in replies:
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == 413
        assert "(4096 bytes, PDSERVE_ROUTER_MAX_REQUEST_BODY_BYTES)" in error["message"]
    assert within.status_code == 200, within.text
    # Counted as the generation requests they are (the tokenize request is not one).
    refused = sample(
        rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="request_too_large"
    )
    assert refused == 2


def outcomes(rt: RouterRuntime, endpoint: str = "/v1/completions") -> dict[str, float]:
    """``pdserve_router_requests_total`` of ``endpoint`` by outcome (those counted)."""
    counted: dict[str, float] = {}
    for family in rt.metrics.registry.collect():
        for metric in family.samples:
            if (
                metric.name == "pdserve_router_requests_total"
                and metric.labels["endpoint"] == endpoint
            ):
                counted[metric.labels["outcome"]] = metric.value
    return counted


async def test_requests_count_under_pdserves_outcomes_not_http_statuses(
    factory: FakeFactory, model_dir: Path
) -> None:
    """The alert on server errors (PdserveRouterServerErrors) tells client errors by outcome:
    a request vLLM's front end refuses counts ``invalid_request``, not ``400``; an error
    mid-stream (a 200 answer) counts its code, not ``ok``."""
    rt = pd_runtime(factory, model_dir, max_migrations=0, local_fallback=False)
    factory.connect(rt.pool.slots()[1].record)
    decode = factory.engines["d0"]
    decode.fail_decode_after = 2
    decode.delta_delay_s = 0.05  # each token its own event before the failure (none merged)
    async with served(rt) as client:
        refused = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0}
        )
        unknown = await client.post(
            "/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 2}
        )
        broken = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True},
        )
    assert refused.status_code == 400, refused.text
    assert unknown.status_code == 404, unknown.text
    assert broken.status_code == 200, broken.text
    assert 'data: {"error"' in broken.text  # after the first token: the stream carries it
    assert outcomes(rt) == {"invalid_request": 1, "model_not_found": 1, "decode_failed": 1}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_hanging_up_is_counted_and_cancels_the_engine_call(
    model_dir: Path, stream: bool
) -> None:
    """The client leaves while the prefill engine works: the call is cancelled (no decode
    starts) and the request counts ``client_disconnected`` (vLLM's front end answers it 200,
    or not at all)."""
    factory = StalledPrefillFactory()
    rt = pd_runtime(factory, model_dir)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream}

    app = create_app(rt.settings, runtime=rt)
    await post_then_hang_up(app, body, factory.prefill_called, bound_s=30, lifespan=True)

    prefill = factory.engines["p0"]
    assert prefill.stalled_calls_closed == prefill.prefills and len(prefill.prefills) == 1
    assert not factory.engines["d0"].decodes
    assert outcomes(rt) == {"client_disconnected": 1}


@dataclasses.dataclass
class StalledPrefill(FakeEngine):
    """A prefill that never answers and says when it was called."""

    called: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stall_prefill: bool = True

    async def prefill(self, request_id: str, *args: Any, **kwargs: Any) -> PrefillResult:
        self.called.set()
        return await super().prefill(request_id, *args, **kwargs)


class StalledPrefillFactory(WordFactory):
    """Every engine's prefill stalls; ``prefill_called`` is set by the first prefill call."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_called = asyncio.Event()

    def connect(self, record: EngineRecord) -> EngineConnector:
        engine = StalledPrefill(record.engine_id, called=self.prefill_called)
        return self.engines.setdefault(record.engine_id, engine)


async def test_a_stream_that_migrated_says_so_in_its_usage(
    factory: FakeFactory, model_dir: Path
) -> None:
    """decode-0 fails after two tokens; the run goes on from another decode engine. A header
    sent with the first token cannot say so: the stream's usage does
    (``usage.pdserve_migrations``)."""
    rt = prepared(
        factory,
        ("p0", EngineRole.PREFILL),
        ("d0", EngineRole.DECODE),
        ("d1", EngineRole.DECODE),
        tokenizer=str(model_dir),
        served_model_name=MODEL,
        policy="round_robin",
    )
    for slot in rt.pool.slots():
        factory.connect(slot.record)
    for engine in ("d0", "d1"):
        factory.engines[engine].delta_delay_s = 0.05  # each token its own event
    factory.engines["d0"].fail_decode_after = 2
    factory.engines["d1"].fail_decode_after = 2
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with served(rt) as client:
        answer = await client.post("/v1/completions", json=body)
        factory.engines["d0"].fail_decode_after = factory.engines["d1"].fail_decode_after = None
        plain = await client.post("/v1/completions", json=body)
    events = json_events(answer.text)
    assert answer.status_code == 200, answer.text
    assert "error" not in events[-1], events[-1]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 6
    migrations = sample(rt, "pdserve_router_migrations_total", reason="decode_failed")
    assert usage["pdserve_migrations"] == migrations >= 1
    assert '"pdserve_migrations"' not in plain.text

"""The router's front end (vLLM's own OpenAI serving code) over a reference-engine PD stack.

The shared reference PD stack (tests/e2e/conftest.py: the hermes tool parser, request chat
templates trusted) answers greedy requests as the shared colocated stack does (the same model on
one engine: what PD must equal), every answer naming its engines. Chat templates are
checked against ``transformers``' ``apply_chat_template`` (what vLLM's server renders with)
through ``/tokenize``, with templates written here that use every construct real checkpoints'
templates use. vLLM's server itself is the yardstick in ``test_vllm_frontend_parity.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from services.bench.sse import json_events
from tests.e2e.conftest import OTHER_MODEL, SHARED_REFERENCE
from tests.e2e.faults.probes import metric
from tests.e2e.up_system import UpSystem, hang_up_mid_stream, healthy_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(SHARED_REFERENCE)]

MODEL = "tiny-model"
PROMPT = "Hello, world! How are you"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "ville / 城市"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]

EVERY_CONSTRUCT = """
{%- if not tools is defined or tools is none -%}{%- set tools = [] -%}{%- endif -%}
{{- bos_token -}}
{%- if tools -%}<tools>{{ tools | tojson(indent=2) }}</tools>{%- endif -%}
Today: {{ strftime_now("%Y") }}
{%- for message in messages -%}
  {%- if message.role == "system" and loop.first -%}
    [SYS]{{ message.content if message.content is string else message.content[0].text }}
    {%- continue -%}
  {%- endif -%}
  {%- if message.role not in ["system", "user", "assistant", "tool"] -%}
    {{- raise_exception("unknown role " + message.role) -}}
  {%- endif -%}
  <|{{ message.role }}|>
  {%- if message.content is string -%}{{ message.content }}
  {%- elif message.content is not none -%}
    {%- for part in message.content -%}
      {%- if part.type == "text" -%}{{ part.text }}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {%- if message.tool_calls is defined and message.tool_calls -%}
    {%- for call in message.tool_calls -%}
      <call>{{ call.function.name }}{{ call.function.arguments | tojson(indent=1) }}</call>
    {%- endfor -%}
  {%- endif -%}
  {%- if loop.index > 50 -%}{%- break -%}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""
"""A template written here with what real ones use: ``tools`` undefined or none,
``tojson(indent=...)``, ``strftime_now``, ``raise_exception``, loop controls, content parts,
``tool_calls`` and ``tool`` messages."""


@pytest.fixture(scope="module")
def system(reference_pd: UpSystem) -> UpSystem:
    return reference_pd


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_answers_equal_colocated_and_carry_pdserve_headers(
    system: UpSystem, reference_colocated: UpSystem
) -> None:
    """Completions (plain, streamed, logprobs, echo with prompt logprobs, a stop string) and
    chat: the same greedy text through PD as on one engine; every PD answer names its
    engines."""
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "logprobs": 2}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "stop": ["e"]}),
        (
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1, "prompt_logprobs": 1},
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10},
        ),
    ]
    for path, fields in bodies:
        body = {"model": MODEL, "temperature": 0, **fields}
        ours, theirs = post(system.url, path, body), post(reference_colocated.url, path, body)
        assert ours.status_code == theirs.status_code == 200, (body, ours.text, theirs.text)
        assert ours.headers["x-pdserve-execution-path"] == "disaggregated", ours.headers
        assert ours.headers["x-pdserve-prefill-engine"] in ("prefill-0", "prefill-1")
        assert ours.headers["x-pdserve-decode-engine"] == "decode-0"
        mine, other = ours.json()["choices"][0], theirs.json()["choices"][0]
        if "message" in mine:
            assert mine["message"]["content"] == other["message"]["content"], body
        else:
            assert mine["text"] == other["text"], body
        assert mine["finish_reason"] == other["finish_reason"], body
        if body.get("logprobs"):
            assert mine["logprobs"]["tokens"] == other["logprobs"]["tokens"], body
            assert mine["logprobs"]["token_logprobs"] == pytest.approx(
                other["logprobs"]["token_logprobs"], abs=1e-4, nan_ok=True
            )
        if body.get("prompt_logprobs"):
            assert len(mine["prompt_logprobs"]) == len(other["prompt_logprobs"])
    streamed = client(system.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    whole = post(
        reference_colocated.url,
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
    )
    assert text == whole.json()["choices"][0]["text"]


def test_tokenize_renders_chat_templates_as_transformers(system: UpSystem, model_dir: Path) -> None:
    """``/tokenize`` with messages: the checkpoint's template, and a request template with
    every construct, with and without tools, equal to ``apply_chat_template``'s tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    simple = [{"role": "user", "content": "Hi there"}]
    expected = tokenizer.apply_chat_template(
        simple, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answer = post(system.url, "/tokenize", {"model": MODEL, "messages": simple})
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == list(expected)
    # vLLM hands templates a tool call's arguments parsed (real templates ``tojson`` them)
    as_rendered = json.loads(json.dumps(TOOL_HISTORY))
    function = as_rendered[2]["tool_calls"][0]["function"]
    function["arguments"] = json.loads(function["arguments"])
    for tools in (None, TOOLS):
        expected = tokenizer.apply_chat_template(
            as_rendered,
            tools=tools,
            chat_template=EVERY_CONSTRUCT,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": TOOL_HISTORY,
            "chat_template": EVERY_CONSTRUCT,
        }
        if tools is not None:
            body["tools"] = tools
        answer = post(system.url, "/tokenize", body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens"] == list(expected), tools


def test_template_errors_are_400_naming_the_error(system: UpSystem) -> None:
    bad_role = [{"role": "critic", "content": "x"}]
    answer = post(
        system.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": bad_role, "chat_template": EVERY_CONSTRUCT, "max_tokens": 2},
    )
    assert answer.status_code == 400, answer.text
    assert "unknown role critic" in answer.json()["error"]["message"]


def test_tools_and_tool_history_through_pd(system: UpSystem) -> None:
    """The official client's ``tools=`` with ``tool_choice`` auto, and a tool-call history: a
    200 whose text is the answer when the parser finds no call (vLLM's rule)."""
    answer = client(system.url).chat.completions.create(
        model=MODEL,
        messages=TOOL_HISTORY,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto",
        max_tokens=8,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls in (None, [])
    assert choice.message.content
    assert choice.finish_reason == "length"
    streamed = client(system.url).chat.completions.create(
        model=MODEL,
        messages=TOOL_HISTORY,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == choice.message.content


def test_endpoints_clients_call(system: UpSystem) -> None:
    assert httpx.get(f"{system.url}/version", timeout=10).json()["version"] == "0.32.0"
    assert httpx.get(f"{system.url}/ping", timeout=10).status_code == 200
    models = httpx.get(f"{system.url}/v1/models", timeout=10).json()["data"]
    # (the shared stack's second base model is listed after the first, with its own context)
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 512), (OTHER_MODEL, 256)]
    tokens = post(system.url, "/tokenize", {"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    text = post(system.url, "/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert PROMPT in text
    response = post(
        system.url,
        "/v1/responses",
        {"model": MODEL, "input": PROMPT, "max_output_tokens": 6, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] == 6
    assert response.headers["x-pdserve-execution-path"] == "disaggregated"


def test_a_client_hanging_up_mid_stream_is_counted_and_cancels_the_decode(
    system: UpSystem,
) -> None:
    """Over uvicorn and real engines: the router counts ``client_disconnected`` (not ``ok``,
    vLLM's answer being a 200) and the decode engine's call ends cancelled."""
    decode_metrics = system.endpoints["metrics"]["decode-0"]
    cancelled_before = metric(decode_metrics, "pdserve_engine_requests_total", outcome="CANCELLED")
    router_metrics = f"{system.url}/metrics"
    disconnects_before = metric(
        router_metrics, "pdserve_router_requests_total", outcome="client_disconnected"
    )
    body = {
        "model": MODEL,
        "prompt": "The client goes away after a few tokens of this long answer",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    answered = hang_up_mid_stream(system.url, body, events=3)
    assert answered["x-pdserve-execution-path"] == "disaggregated"
    deadline = time.monotonic() + 60
    while (
        metric(router_metrics, "pdserve_router_requests_total", outcome="client_disconnected")
        <= disconnects_before
        or metric(decode_metrics, "pdserve_engine_requests_total", outcome="CANCELLED")
        <= cancelled_before
    ):
        assert time.monotonic() < deadline, "the hang-up was not counted, or not cancelled"
        time.sleep(0.1)


def test_n_forks_on_reference_engines(system: UpSystem) -> None:
    """``n = 3`` sampled: three choices from one prefill forked on decode (counted)."""
    before = system.metric("pdserve_router_choices_total", path="forked")
    answer = client(system.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert system.metric("pdserve_router_choices_total", path="forked") == before + 1
    again = client(system.url).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]


def test_refused_as_vllm_or_naming_what_pdserve_lacks(system: UpSystem) -> None:
    unknown = post(system.url, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404
    greedy_n = post(
        system.url,
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "n": 2, "temperature": 0, "max_tokens": 2},
    )
    assert greedy_n.status_code == 400  # vLLM refuses n > 1 at temperature 0
    structured = post(
        system.url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
            "response_format": {"type": "json_object"},
        },
    )
    assert structured.status_code == 400
    assert structured.json()["error"]["param"] == "structured_outputs"
    ignored = post(
        system.url,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 2,
            "ignore_eos": True,  # sampled at vLLM's default temperature: EOS may come first
            "no_such_field": 1,
            "best_of": 1,
        },
    )
    assert ignored.status_code == 200, ignored.text
    assert json.loads(ignored.text)["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def local_router(system: UpSystem, model_dir: Path) -> Iterator[str]:
    """A router with vLLM's front end on the same engines that runs a prompt the decode engine
    holds there alone (the default ``local_cached_fraction``), reporting cached tokens."""
    with healthy_router(
        system,
        "--tokenizer", str(model_dir), "--frontend-arg=--enable-prompt-tokens-details",
    ) as url:  # fmt: skip
        yield url


def test_a_local_run_reports_its_cached_tokens_streamed_and_not(local_router: str) -> None:
    """Issue 31: a prompt the decode engine holds runs there alone, and the answer's
    ``usage.prompt_tokens_details.cached_tokens`` says what it found, streamed too. vLLM's
    front end takes cached tokens from a request's first output; a local run's came only with
    its last delta, so every local run read 0."""
    prompt = " ".join(f"w{i}" for i in range(60))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
    first = post(local_router, "/v1/completions", body)
    assert first.status_code == 200, first.text
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    # The decode engine's KV events reach the router within moments: until they have, the
    # repeat is disaggregated again.
    deadline = time.monotonic() + 60
    while True:
        whole = post(local_router, "/v1/completions", body)
        if whole.headers["x-pdserve-execution-path"] == "local":
            break
        assert time.monotonic() < deadline, "no repeat ran on the decode engine alone"
        time.sleep(0.5)
    cached = whole.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens // 2 <= cached < prompt_tokens, whole.json()["usage"]
    streamed = post(
        local_router,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert streamed.headers["x-pdserve-execution-path"] == "local", streamed.headers
    events = json_events(streamed.text)
    usage = events[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached, usage

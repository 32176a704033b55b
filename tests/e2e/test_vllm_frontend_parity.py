"""pdserve (``pdserve up --engine vllm``: disaggregated, vLLM's front end) against vLLM's own
OpenAI server on the same tiny checkpoint with the same front-end flags: a request matrix
(completions, chat, tools, logprobs, prompt logprobs, echo, n, penalties, stop, streaming
options, Responses, tokenize) answered with the same status and the same JSON, ids and
timestamps aside, floats within 1e-3.

Structured outputs (``response_format``, ``structured_outputs``, ``tool_choice`` required or
named) are rows like the others: the constrained output through PD equals vLLM's own.

LoRA (issue 48): both serve the same random adapter from the start (``--lora-modules``); rows
naming it run with it on prefill and decode and answer as vLLM's server does, logprobs
included. Both take adapters at run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): loads,
unloads, bad folders and unknown names answer alike
(:func:`test_lora_adapters_at_run_time_as_on_vllm_server`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest

from services.bench.sse import json_events
from services.engines.reference.tiny_lora import make_tiny_lora
from tests.e2e.conftest import LORA_ENV, MODEL, VLLM_SERVER, VLLM_SERVER_FLAGS, VllmServer
from tests.e2e.conftest import VLLM_SERVER_ADAPTER as ADAPTER
from tests.e2e.up_system import UpSystem

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.xdist_group(VLLM_SERVER),  # its vLLM server is test_vllm_pd's reference too
]

FRONTEND_FLAGS = VLLM_SERVER_FLAGS
START_TIMEOUT_S = 900.0
PROMPT = "The quick brown fox jumps over the lazy dog while prefill reads the prompt"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_HISTORY = [
    *CHAT,
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
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
}

Row = tuple[str, dict[str, Any]]
MATRIX: list[Row] = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12}),
    ("/v1/completions", {"prompt": [PROMPT, "Hello"], "max_tokens": 5}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop": [" a", "e"]}),
    (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "stop": ["e"], "include_stop_str_in_output": True},
    ),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "logprobs": 3}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "prompt_logprobs": 2}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 2}),  # 400: greedy n > 1
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "seed": 11}),
    # Beam search: vLLM's serving layer runs it as one-token requests over the engine client
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True}),
    (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 16,
            "presence_penalty": 1.5,
            "frequency_penalty": 1.0,
            "repetition_penalty": 1.3,
            "min_tokens": 8,
            "ignore_eos": True,
        },
    ),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "logit_bias": {"65": 50}}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 600}),  # 400: context
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "no_such_field": 1, "guided_json": {}}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "model": "nope"}),  # 404
    # LoRA through PD: the adapter's KV made on prefill is what decode continues
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "model": ADAPTER, "logprobs": 2}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 12, "model": ADAPTER, "stream": True},
    ),
    (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "tools": TOOLS}),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 6, "tools": TOOLS, "tool_choice": "none"},
    ),
    (
        "/v1/chat/completions",
        {"messages": TOOL_HISTORY, "max_tokens": 6, "tools": TOOLS, "stream": True},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [*CHAT, {"role": "assistant", "content": "The capital"}],
            "max_tokens": 6,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "echo": True,
        },
    ),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "chat_template": TEMPLATE}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "chat_template": "{% if %}"}),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 6}),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 6, "stream": True}),
    ("/tokenize", {"prompt": PROMPT}),
    ("/tokenize", {"messages": TOOL_HISTORY, "tools": TOOLS}),
    ("/tokenize", {"messages": CHAT, "chat_template": TEMPLATE}),
    ("/detokenize", {"tokens": [0, 65, 66, 67, 200]}),
]

MATRIX += [
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 24, "response_format": {"type": "json_object"}},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 24,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": CITY_SCHEMA},
            },
        },
    ),
    (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}},
    ),
    (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{3,6}"}},
    ),
    (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 12,
            "structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9] ("+" [0-9])*'},
        },
    ),
    (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "("}},
    ),  # 400: the regex does not compile
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 24, "tools": TOOLS, "tool_choice": "required"},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 24,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "guided_choice": ["a", "b"]}),
]
"""Structured outputs through PD: the prefill's first token obeys the constraint, the decode's
grammar accepts it before sampling on (``contracts.advance_grammar``)."""

UNSTABLE_KEYS = frozenset(
    {"id", "item_id", "created", "created_at", "system_fingerprint", "root", "sequence_number"}
)
"""Per-answer ids and times (and a stream event's number: how tokens group into events is
timing, see :func:`streamed`); the config hash in ``system_fingerprint``; ``root`` (a path)."""


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, vllm_server: VllmServer) -> dict[str, Path]:
    """Random adapters of the tiny checkpoint (PEFT layout): ``sql`` (served from the start,
    the vLLM server's), ``chat`` (loaded at run time), ``big`` (rank 32, above the default
    max_lora_rank 16) and ``empty`` (a folder with no adapter in it)."""
    root = tmp_path_factory.mktemp("adapters")
    (root / "empty").mkdir()
    model_dir = vllm_server.model_dir
    return {
        ADAPTER: vllm_server.adapter_dir,
        "chat": make_tiny_lora(root / "chat", model_dir, seed=2),
        "big": make_tiny_lora(root / "big", model_dir, rank=32, seed=3),
        "empty": root / "empty",
    }


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory,
    vllm_server: VllmServer,
    adapters: dict[str, Path],
) -> Iterator[tuple[str, str]]:
    """vLLM's own server (tests/e2e/conftest.py: started on first use, kept for
    ``test_vllm_pd``) and ``pdserve up --engine vllm``, starting together, both serving
    :data:`ADAPTER` and taking adapters at run time."""
    model_dir = vllm_server.model_dir
    lora = f"{ADAPTER}={adapters[ADAPTER]}"
    pd = UpSystem(
        tmp_path_factory.mktemp("parity-pd"),
        "--engine", "vllm", "--model", str(model_dir), "--dtype", "float32",
        "--block-size", "32", "--engine-arg=--enforce-eager", "--port", "0", "--no-restart",
        *(f"--frontend-arg={flag}" for flag in FRONTEND_FLAGS),
        "--lora-modules", lora,
        # every request disaggregated
        env={"PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2", **LORA_ENV},
        scrub_env=True,
    )  # fmt: skip
    try:
        url = vllm_server.url()
        pd.wait_ready(START_TIMEOUT_S)
        yield url, pd.url
    finally:
        assert pd.stop() == 0, pd.output()


def send(url: str, path: str, fields: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    body = {"model": MODEL, "temperature": 0, **fields}
    if path in ("/tokenize", "/detokenize"):
        body.pop("temperature")
    answer = httpx.post(f"{url}{path}", json=body, timeout=300)
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = json_events(answer.text)
        return answer.status_code, events, dict(answer.headers)
    return answer.status_code, answer.json(), dict(answer.headers)


def streamed(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client reassembles from an event stream: how many tokens one event carries
    depends on when the router read them (vLLM's server groups them too), not on the answer."""
    if events and "type" in events[0]:  # the Responses API
        delta = "response.output_text.delta"
        return {
            "events": [event["type"] for event in events if event["type"] != delta],
            "text": "".join(event["delta"] for event in events if event["type"] == delta),
            "last": events[-1],
        }
    choices: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event.get("choices", []):
            entry = choices.setdefault(choice["index"], {"text": "", "tool_calls": []})
            delta = choice.get("delta") or {}
            entry["text"] += choice.get("text") or delta.get("content") or ""
            entry["tool_calls"] += delta.get("tool_calls") or []
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    entry[key] = choice[key]
            if delta.get("role"):
                entry["role"] = delta["role"]
    usage = [event["usage"] for event in events if event.get("usage")]
    return {"choices": choices, "usage": usage[-1] if usage else None}


def same(vllm: Any, ours: Any, where: str = "") -> None:
    """Equal JSON but for :data:`UNSTABLE_KEYS`; floats within 1e-3."""
    if isinstance(vllm, dict):
        assert isinstance(ours, dict), where
        keys = set(vllm) - UNSTABLE_KEYS
        theirs = set(ours) - UNSTABLE_KEYS
        assert keys == theirs, (where, sorted(keys ^ theirs))
        for key in keys:
            same(vllm[key], ours[key], f"{where}.{key}")
    elif isinstance(vllm, list):
        assert isinstance(ours, list) and len(vllm) == len(ours), (where, vllm, ours)
        for index, (a, b) in enumerate(zip(vllm, ours, strict=True)):
            same(a, b, f"{where}[{index}]")
    elif isinstance(vllm, float) and isinstance(ours, float):
        assert ours == pytest.approx(vllm, abs=1e-3), where
    else:
        assert vllm == ours, where


@pytest.mark.parametrize(
    ("path", "fields"), MATRIX, ids=[f"{p}-{i}" for i, (p, _) in enumerate(MATRIX)]
)
def test_same_answer_as_vllm_server(
    servers: tuple[str, str], path: str, fields: dict[str, Any]
) -> None:
    vllm_url, pd_url = servers
    vllm_status, vllm_body, _ = send(vllm_url, path, fields)
    status, body, headers = send(pd_url, path, fields)
    assert status == vllm_status, (vllm_body, body)
    if status == 200 and path not in {"/tokenize", "/detokenize"}:
        assert headers["x-pdserve-execution-path"] == "disaggregated", headers
    if isinstance(vllm_body, dict) and "error" in vllm_body:
        assert body["error"]["type"] == vllm_body["error"]["type"]
        assert body["error"]["code"] == vllm_body["error"]["code"]
        return
    if isinstance(vllm_body, list):
        vllm_body, body = streamed(vllm_body), streamed(body)
    same(vllm_body, body)


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    sunny: bool


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What the client made of a structured answer: the parsed object, or the text it could
    not parse because the length limit came first, or the streaming parser's complaint (the
    tiny model's JSON is valid but may run long and hold control characters)."""
    try:
        return "parsed", call()
    except openai.LengthFinishReasonError as exc:
        return "length", exc.completion.choices[0].message.content
    except ValueError as exc:  # the streaming parser on partial JSON with control characters
        return "unparsable", str(exc)


def test_openai_client_parse_and_tools_as_on_vllm_server(servers: tuple[str, str]) -> None:
    """The official client's ``beta.chat.completions.parse`` with a pydantic model (plain and
    streamed) and ``tools=`` with a named ``tool_choice``: the same outcome as on vLLM's."""
    answers = []
    for url in servers:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

        def parse(client: openai.OpenAI = client) -> Any:
            answer = client.beta.chat.completions.parse(
                model=MODEL, messages=CHAT, response_format=City, max_tokens=40, temperature=0
            )
            return answer.choices[0].message.parsed

        def parse_streamed(client: openai.OpenAI = client) -> Any:
            with client.beta.chat.completions.stream(
                model=MODEL, messages=CHAT, response_format=City, max_tokens=40, temperature=0
            ) as stream:
                return stream.get_final_completion().choices[0].message.parsed

        called = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=40,
            temperature=0,
        )
        calls = called.choices[0].message.tool_calls or []
        answers.append(
            (outcome(parse), outcome(parse_streamed), [c.function.model_dump() for c in calls])
        )
    assert answers[0] == answers[1]
    assert answers[0][0][1]  # something was generated (an object or its start)


def test_lora_adapters_at_run_time_as_on_vllm_server(
    servers: tuple[str, str], adapters: dict[str, Path]
) -> None:
    """Issue 48: on both servers, ``/v1/models`` lists the adapter (parent, root); a run-time
    load answers alike and the adapter answers alike token for token (disaggregated here);
    base-model answers are unchanged by the adapters beside them; a folder with no adapter is
    vLLM's 404, a rank above max_lora_rank vLLM's 500 with vLLM's message, an unknown name
    vLLM's 404 body, and neither failure changes what is served; an unload answers alike and
    its name is then unknown on both."""
    answers: list[list[Any]] = []
    for url in servers:
        seen: list[Any] = []

        def post(path: str, body: dict[str, Any], url: str = url) -> tuple[int, Any]:
            answer = httpx.post(f"{url}{path}", json=body, timeout=300)
            is_json = answer.headers.get("content-type", "").startswith("application/json")
            return answer.status_code, answer.json() if is_json else answer.text

        def complete(model: str, url: str = url) -> tuple[int, Any]:
            status, body, headers = send(
                url, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 10}
            )
            if status == 200 and url == servers[1]:
                assert headers["x-pdserve-execution-path"] == "disaggregated"
            return status, body["choices"][0]["text"] if status == 200 else body

        def models(url: str = url) -> list[tuple[str, Any, Any]]:
            cards = httpx.get(f"{url}/v1/models", timeout=60).json()["data"]
            return [(c["id"], c.get("parent"), c.get("root")) for c in cards]

        assert models()[1:] == [(ADAPTER, MODEL, str(adapters[ADAPTER]))]
        base = complete(MODEL)
        chat = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
        seen.append(post("/v1/load_lora_adapter", chat))
        seen.append(complete("chat"))
        seen.append(complete(ADAPTER))
        assert complete(MODEL) == base  # unchanged by the adapters loaded beside it
        assert len({base[1], seen[1][1], seen[2][1]}) == 3  # each adapter changes the answer
        empty = post(
            "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": str(adapters["empty"])}
        )
        seen.append(empty)
        big = post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": str(adapters["big"])})
        seen.append((big[0], big[1]["error"]["type"]))
        assert "LoRA rank 32 is greater than max_lora_rank 16." in big[1]["error"]["message"]
        seen.append(complete("big"))
        seen.append(complete("chat"))  # the failed loads changed nothing
        seen.append(post("/v1/unload_lora_adapter", {"lora_name": "chat"}))
        seen.append(complete("chat"))
        seen.append(models())
        answers.append(seen)
    vllm, ours = answers
    assert ours == vllm
    assert ours[0] == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert ours[3][0] == 404 and ours[4][0] == 500 and ours[5][0] == 404

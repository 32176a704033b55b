"""Fuzzing of the generation endpoints' request bodies (hypothesis): no body yields a 5xx.

vLLM's front end over pdserve's executor, in process (httpx's ASGI transport, the app's
lifespan run once for every example) over fake engines that also send the logprobs a request
asks for (as pdserve's engines do). Whatever the body (any JSON, the endpoint's fields with
plausible or arbitrary values, bytes that are no JSON at all), the answer is never a 5xx, an
event stream carries no 5xx error event, and every 4xx is the OpenAI error envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.bench.sse import json_events
from services.control_plane.wire import EngineRecord, EngineRole
from services.engines.requests import (
    DecodeRequest,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
)
from services.engines.trace_context import TraceContext
from services.serving.client.connector import EngineConnector
from tests.unit.router.fakes import MODEL, FakeEngine, FakeFactory, http, prepared

ENVELOPE = {"message", "type", "param", "code"}


def row(token_id: int, top: int | None) -> TokenLogprobs:
    """A logprobs row of ``token_id`` with ``top`` alternatives (ids of the vocabulary)."""
    return TokenLogprobs(
        token_id, -0.5, 1, tuple((300 + rank, -1.0 - rank) for rank in range(top or 0))
    )


@dataclasses.dataclass
class LogprobsEngine(FakeEngine):
    """A :class:`FakeEngine` that sends the sample and prompt logprobs a request asks for."""

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
        lora: object = None,
    ) -> PrefillResult:
        result = await super().prefill(
            request_id, prompt_token_ids, sampling, timeout_s=timeout_s, trace=trace
        )
        top = sampling.logprobs
        if top is not None:
            result = dataclasses.replace(
                result,
                logprobs=row(result.first_token_id, top),
                more_choices=tuple(
                    dataclasses.replace(more, logprobs=row(more.token_id, top))
                    for more in result.more_choices
                ),
            )
        if sampling.prompt_logprobs is not None:
            prompt = tuple(row(t, sampling.prompt_logprobs) for t in prompt_token_ids[1:])
            result = dataclasses.replace(result, prompt_logprobs=prompt)
        return result

    async def decode(
        self, request: DecodeRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[TokenDelta]:
        sampling = request.sampling
        first = True
        async for delta in super().decode(request, timeout_s=timeout_s):
            sent = delta
            if sampling.logprobs is not None:
                logprobs = tuple(row(t, sampling.logprobs) for t in delta.token_ids)
                sent = dataclasses.replace(sent, logprobs=logprobs)
            if first and request.kv_handle is None and sampling.prompt_logprobs is not None:
                prompt = request.prompt_token_ids[1:]
                prompt_rows = tuple(row(t, sampling.prompt_logprobs) for t in prompt)
                sent = dataclasses.replace(sent, prompt_logprobs=prompt_rows)
            first = False
            yield sent


class LogprobsFactory(FakeFactory):
    def connect(self, record: EngineRecord) -> EngineConnector:
        return self.engines.setdefault(record.engine_id, LogprobsEngine(record.engine_id))


Post = Callable[[str, bytes], httpx.Response]


@pytest.fixture(scope="module")
def post() -> Iterator[Post]:
    """POST a body to the app, which runs (lifespan and all) on one event loop for the whole
    module: hypothesis drives a synchronous test, each example one request on that loop."""
    rt = prepared(LogprobsFactory(), ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
    with asyncio.Runner() as runner:
        stack = contextlib.AsyncExitStack()
        client = runner.run(stack.enter_async_context(http(rt)))

        def call(path: str, body: bytes) -> httpx.Response:
            request = client.post(path, content=body, headers={"content-type": "application/json"})
            return runner.run(asyncio.wait_for(request, 60))

        try:
            yield call
        finally:
            runner.run(stack.aclose())


# --- bodies -------------------------------------------------------------------------------

numbers = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([-(2**63), 2**63 - 1, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value (NaN and infinities too, as Python's ``json`` writes them)."""

token_ids = st.lists(st.integers(0, 300), min_size=1, max_size=8)
text = st.text(max_size=20)
stop = st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(max_size=3), max_size=4))
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer"])},
        optional={
            "content": st.one_of(
                text,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
            ),
            "name": st.text(max_size=5),
        },
    ),
    min_size=1,
    max_size=3,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.text(min_size=1, max_size=5)},
                optional={"parameters": st.just({"type": "object"})},
            ),
        }
    ),
    max_size=2,
)
probability = st.floats(0, 1)
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": probability,
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "stop": stop,
    "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 8),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3),
    "prompt_logprobs": st.integers(0, 5),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    "structured_outputs": st.fixed_dictionaries({"choice": st.lists(text, min_size=1)}),
    "guided_json": json_values,  # (removed from vLLM: ignored)
    "best_of": st.integers(1, 3),
    "use_beam_search": st.booleans(),
    "length_penalty": st.floats(-2, 2),
    "truncate_prompt_tokens": st.integers(-1, 10),
    "bad_words": st.lists(st.text(max_size=3), max_size=2),
    "allowed_token_ids": token_ids,
    "user": st.text(max_size=8),
    "priority": st.integers(-5, 5),
}
FIELDS: dict[str, tuple[dict[str, st.SearchStrategy[Any]], dict[str, st.SearchStrategy[Any]]]] = {
    # path: (the fields a request needs, the others)
    "/v1/completions": (
        {
            "prompt": st.one_of(
                text, token_ids, st.lists(text, min_size=1, max_size=3), st.lists(token_ids)
            )
        },
        {
            **SAMPLING,
            "echo": st.booleans(),
            "logprobs": st.integers(0, 5),
            "suffix": st.text(max_size=5),
        },
    ),
    "/v1/chat/completions": (
        {"messages": messages},
        {
            **SAMPLING,
            "max_completion_tokens": st.integers(1, 8),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 5),
            "tools": tools,
            "tool_choice": st.sampled_from(["none", "auto", "required"]),
            "parallel_tool_calls": st.booleans(),
            "add_generation_prompt": st.booleans(),
            "continue_final_message": st.booleans(),
            "echo": st.booleans(),
            "chat_template_kwargs": st.dictionaries(st.text(max_size=5), json_values, max_size=2),
        },
    ),
    "/v1/responses": (
        {"input": st.one_of(text, messages)},
        {
            "instructions": st.text(max_size=10),
            "max_output_tokens": st.integers(1, 8),
            "temperature": SAMPLING["temperature"],
            "top_p": SAMPLING["top_p"],
            "stream": st.booleans(),
            "tools": tools,
            "tool_choice": st.sampled_from(["none", "auto", "required"]),
            "text": st.fixed_dictionaries(
                {"format": st.fixed_dictionaries({"type": st.sampled_from(["text"])})}
            ),
            "store": st.booleans(),
            "background": st.booleans(),
            "previous_response_id": st.text(max_size=8),
            "include": st.lists(st.sampled_from(["message.output_text.logprobs"]), max_size=1),
            "truncation": st.sampled_from(["auto", "disabled"]),
            "top_logprobs": st.integers(0, 5),
        },
    ),
}


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """A body for ``path``: a request of its fields with plausible values; or such a request
    with any field, known or not, set to any JSON value; or any JSON value; or bytes."""
    needed, others = FIELDS[path]
    names = sorted([*needed, *others, "model"])
    plausible = st.fixed_dictionaries({"model": st.just(MODEL), **needed}, optional=others)
    anything = st.builds(
        lambda request, changed: {**request, **changed},
        plausible,
        st.dictionaries(st.sampled_from(names) | st.text(max_size=8), json_values, max_size=3),
    )
    return st.one_of(
        plausible.map(json.dumps),
        anything.map(json.dumps),
        anything.map(json.dumps),
        json_values.map(json.dumps),
        st.binary(max_size=40),
    ).map(lambda body: body if isinstance(body, bytes) else body.encode())


def error_events(text: str) -> list[dict[str, Any]]:
    """The error events of an event stream: vLLM's ``{"error": {...}}`` (chat, completions)
    and the Responses API's ``{"type": "error", ...}``."""
    return [
        event for event in json_events(text) if "error" in event or event.get("type") == "error"
    ]


def utf8(body: bytes) -> bool:
    try:
        body.decode()
    except UnicodeDecodeError:
        return False
    return True


UNDECODABLE = {"detail": "There was an error parsing the body"}
"""FastAPI's answer to a body that is no text (vLLM's server answers it too: its handlers
cover validation errors, not FastAPI's ``HTTPException``): not the OpenAI envelope."""


def check(response: httpx.Response, body: bytes) -> None:
    """The answer to ``body``: no 5xx, before or in its stream; a 4xx is the envelope."""
    assert response.status_code < 500, response.text[:2000]
    if response.status_code >= 400:
        answer = response.json()
        if answer == UNDECODABLE and response.status_code == 400:
            assert not utf8(body)
            return
        error = answer["error"]
        assert set(error) == ENVELOPE, error
        assert error["code"] == response.status_code
        assert isinstance(error["message"], str) and error["message"]
        return
    assert response.status_code == 200, response.text[:2000]
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith(("data: [DONE]", "}")), response.text[-500:]
        for event in error_events(response.text):
            error = event.get("error", event)
            code = error.get("code") if isinstance(error, dict) else None
            assert not (isinstance(code, int) and code >= 500), event
    else:
        assert isinstance(response.json(), dict)


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_no_body_gets_a_server_error(post: Post, path: str) -> None:
    seen: set[int] = set()

    # Derandomized: the same examples every run (a CI failure reproduces), shrunk on failure.
    @settings(
        max_examples=150,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(path))
    def fuzz(body: bytes) -> None:
        response = post(path, body)
        seen.add(response.status_code)
        check(response, body)

    fuzz()
    # The fuzzing reached the engines and the refusals both.
    assert 200 in seen and 400 in seen, seen


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        # vLLM's check_structured_outputs_count (a "before" model validator) calls
        # structured_outputs.get(...) on whatever the field holds: AttributeError, a 500.
        ("/v1/completions", {"prompt": "hi", "structured_outputs": []}, "structured_outputs"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": "x"}, "structured_outputs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "structured_outputs": 1},
            "structured_outputs",
        ),
        # echo of an empty prompt in a list: vLLM asserts the prompt's text is not None (a
        # 500 from vLLM's own server too)
        ("/v1/completions", {"prompt": ["", "hi"], "echo": True, "logprobs": 0}, "prompt"),
        # The request model takes null; the streamed response's model refuses it once the
        # stream has started (ResponsesResponse: a ValidationError, no answer at all).
        ("/v1/responses", {"input": "hi", "stream": True, "background": None}, "background"),
        ("/v1/responses", {"input": "hi", "stream": True, "truncation": None}, "truncation"),
    ],
)
def test_bodies_the_fuzzing_found_are_refused_not_failed(
    post: Post, path: str, body: dict[str, Any], field: str
) -> None:
    raw = json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()
    response = post(path, raw)
    check(response, raw)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field, response.text

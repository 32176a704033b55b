"""The HTTP request's W3C trace context reaches every engine call of the request (vLLM's front
end hands its ``traceparent``/``tracestate`` to the router's engine client, which checks them:
``trace_headers.from_vllm``), over fake engine connectors: Prefill and Decode, a forked
``n > 1`` run's, the backstop Abort's; an invalid ``traceparent`` or ``tracestate`` is dropped,
counted, and the request is answered as usual. The metadata on a real gRPC call:
tests/integration/services/test_trace_propagation.py."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.control_plane.wire import EngineRole
from services.engines.errors import EngineOverloaded
from services.engines.trace_context import TraceContext
from services.router.frontend.trace_headers import from_vllm
from services.router.metrics import RouterMetrics
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import MODEL, FakeFactory, http, prepared, sample

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
DROPPED = "pdserve_router_trace_context_dropped_total"


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


@pytest.fixture
def rt(factory: FakeFactory) -> RouterRuntime:
    return prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))


def calls(factory: FakeFactory) -> list[tuple[str, str, TraceContext | None]]:
    return [call for engine in factory.engines.values() for call in engine.traces]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hello there"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_every_engine_call_carries_the_requests_trace_context(
    factory: FakeFactory, rt: RouterRuntime, path: str, body: dict[str, object], stream: bool
) -> None:
    headers = {"traceparent": TRACEPARENT, "tracestate": "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE"}
    async with http(rt) as client:
        answer = await client.post(
            path, json={"model": MODEL, "max_tokens": 3, "stream": stream, **body}, headers=headers
        )
    assert answer.status_code == 200, answer.text
    trace = TraceContext(TRACEPARENT, TRACESTATE)  # tracestate's optional whitespace removed
    assert [(call, trace_of) for call, _, trace_of in calls(factory)] == [
        ("prefill", trace),
        ("decode", trace),
    ]
    assert sample(rt, DROPPED, header="traceparent") == sample(rt, DROPPED, header="tracestate")
    assert sample(rt, DROPPED, header="traceparent") == 0


async def test_without_a_traceparent_the_engines_get_no_trace_context(
    factory: FakeFactory, rt: RouterRuntime
) -> None:
    async with http(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
            headers={"tracestate": TRACESTATE},  # alone it means nothing: not counted
        )
    assert answer.status_code == 200, answer.text
    assert [trace for _, _, trace in calls(factory)] == [None, None]
    assert sample(rt, DROPPED, header="tracestate") == 0


@pytest.mark.parametrize(
    ("headers", "sent", "dropped"),
    [
        # Uppercase hex: not W3C; the request runs without a trace context.
        ({"traceparent": TRACEPARENT.upper(), "tracestate": TRACESTATE}, None, "traceparent"),
        ({"traceparent": f"00-{'0' * 32}-00f067aa0ba902b7-01"}, None, "traceparent"),
        ({"traceparent": "00-not-a-trace-01"}, None, "traceparent"),
        # A key twice in tracestate: the traceparent still goes, without it.
        (
            {"traceparent": TRACEPARENT, "tracestate": "a=1,a=2"},
            TraceContext(TRACEPARENT),
            "tracestate",
        ),
    ],
)
async def test_an_invalid_header_is_dropped_and_counted_never_a_400(
    factory: FakeFactory,
    rt: RouterRuntime,
    headers: dict[str, str] | list[tuple[str, str]],
    sent: TraceContext | None,
    dropped: str,
) -> None:
    async with http(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
            headers=headers,
        )
    assert answer.status_code == 200, answer.text
    assert [trace for _, _, trace in calls(factory)] == [sent, sent]
    assert sample(rt, DROPPED, header=dropped) == 1
    other = "tracestate" if dropped == "traceparent" else "traceparent"
    assert sample(rt, DROPPED, header=other) == 0


async def test_forked_choices_and_the_backstop_abort_carry_it_too(
    factory: FakeFactory, rt: RouterRuntime
) -> None:
    trace = TraceContext(TRACEPARENT)
    async with http(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "n": 2, "seed": 1},
            headers={"traceparent": TRACEPARENT},
        )
        assert answer.status_code == 200, answer.text
        assert rt.metrics.registry.get_sample_value(
            "pdserve_router_choices_total", {"path": "forked"}
        )
        assert [(call, t) for call, _, t in calls(factory)] == [
            ("prefill", trace),
            ("decode", trace),
        ]
        # The decode engine refuses the request: the router releases the KV the prefill
        # engine holds with an Abort, which belongs to the request as much as its Prefill.
        factory.engines["d1"].decode_error = EngineOverloaded("full")
        factory.engines["p1"].traces.clear()
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
            headers={"traceparent": TRACEPARENT},
        )
        assert answer.status_code >= 500, answer.text
        await rt.executor.calls.close()  # the abort is sent in the background
    prefill_engine = factory.engines["p1"].traces
    assert ("abort", trace) in [(call, t) for call, _, t in prefill_engine]
    aborted = next(request_id for call, request_id, _ in prefill_engine if call == "abort")
    assert aborted in factory.engines["p1"].prefills


async def test_a_repeated_traceparent_field_goes_as_vllm_reads_it_the_first(
    factory: FakeFactory, rt: RouterRuntime
) -> None:
    """vLLM's serving classes read one value per header name (the first field line): the
    engines get that one, and nothing is dropped."""
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with http(rt) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
            headers=[("traceparent", TRACEPARENT), ("traceparent", other)],
        )
    assert answer.status_code == 200, answer.text
    assert [trace for _, _, trace in calls(factory)] == [TraceContext(TRACEPARENT)] * 2
    assert sample(rt, DROPPED, header="traceparent") == 0


@pytest.mark.parametrize(
    ("headers", "expected", "dropped"),
    [
        (None, None, None),
        ({}, None, None),
        ({"tracestate": TRACESTATE}, None, None),
        ({"traceparent": TRACEPARENT}, TraceContext(TRACEPARENT), None),
        (
            {"traceparent": TRACEPARENT, "tracestate": TRACESTATE},
            TraceContext(TRACEPARENT, TRACESTATE),
            None,
        ),
        ({"traceparent": TRACEPARENT.upper()}, None, "traceparent"),
        (
            {"traceparent": TRACEPARENT, "tracestate": "a=1,a=2"},
            TraceContext(TRACEPARENT),
            "tracestate",
        ),
    ],
)
def test_from_vllm_checks_the_headers_vllm_extracted(
    headers: dict[str, str] | None, expected: TraceContext | None, dropped: str | None
) -> None:
    metrics = RouterMetrics(CollectorRegistry())
    assert from_vllm(headers, metrics) == expected
    for header in ("traceparent", "tracestate"):
        counted = metrics.registry.get_sample_value(
            "pdserve_router_trace_context_dropped_total", {"header": header}
        )
        assert (counted or 0) == (1 if header == dropped else 0)

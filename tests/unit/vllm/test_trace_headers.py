"""The vllm backend hands a request's W3C trace context to vLLM as ``AsyncLLM.generate``'s
``trace_headers``, so vLLM's own OpenTelemetry request span is a child of the caller's, and only
when vLLM's tracing is configured (``otlp_traces_endpoint``; without it vLLM drops them and warns
per request).

``AsyncLLM`` is replaced by a recorder of its ``generate`` calls: starting a real vLLM engine
takes about a minute on CPU, and what is checked here is the call pdserve makes; the keyword is
checked against the installed vLLM's own signature.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.control_plane.wire import EngineRole
from services.engines.backend import EngineRegistration
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import DecodeRequest, PrefillRequest, SamplingParams
from services.engines.trace_context import TraceContext
from services.engines.vllm.backend import VllmBackend
from services.engines.vllm.options import VllmEngineOptions

TRACE = TraceContext("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "rojo=1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


class RecordingAsyncLLM:
    """``AsyncLLM.generate``'s calling convention; one finished output per call."""

    def __init__(self) -> None:
        self.trace_headers: list[Mapping[str, str] | None] = []

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        *,
        trace_headers: Mapping[str, str] | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[Any]:
        self.trace_headers.append(trace_headers)
        completion = SimpleNamespace(
            token_ids=[5], text=" x", finish_reason="length", logprobs=None
        )
        yield SimpleNamespace(
            outputs=[completion],
            prompt_logprobs=None,
            num_cached_tokens=0,
            num_cache_creation_tokens=0,
            kv_transfer_params=None,
        )


def started(model_dir: Path, endpoint: str | None) -> tuple[VllmBackend, RecordingAsyncLLM]:
    backend = VllmBackend(VllmEngineOptions(model_dir, otlp_traces_endpoint=endpoint))
    engine = RecordingAsyncLLM()
    backend._engine = engine
    backend._registration = EngineRegistration("decode-0", 1, EngineRole.DECODE)
    return backend, engine


def test_the_keyword_is_vllms() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415 (vLLM is heavy)

    assert "trace_headers" in inspect.signature(AsyncLLM.generate).parameters


@pytest.mark.parametrize(
    ("endpoint", "trace", "expected"),
    [
        ("http://collector:4317", TRACE, TRACE.headers()),
        ("http://collector:4317", None, None),
        (None, TRACE, None),  # tracing not configured: vLLM would drop them with a warning
    ],
)
async def test_decode_passes_the_trace_context_to_vllm_when_it_traces(
    model_dir: Path,
    endpoint: str | None,
    trace: TraceContext | None,
    expected: dict[str, str] | None,
) -> None:
    backend, engine = started(model_dir, endpoint)
    request = DecodeRequest("r-1", (1, 2, 3), SamplingParams(max_tokens=1), trace=trace)
    deltas = [delta async for delta in backend.decode(request)]
    assert [d.token_ids for d in deltas] == [(5,)]
    assert engine.trace_headers == [expected]


async def test_prefill_passes_it_too(model_dir: Path) -> None:
    backend, engine = started(model_dir, "http://collector:4317")
    backend._registration = EngineRegistration("prefill-0", 1, EngineRole.PREFILL)
    request = PrefillRequest("r-2", (1, 2), SamplingParams(max_tokens=1), TRACE)
    result = await backend.prefill(request)
    assert result.first_token_id == 5
    assert engine.trace_headers == [TRACE.headers()]

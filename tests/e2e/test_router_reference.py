"""The reference engine through the router: PD (prefill PP=2 -> decode) against colocated.

The two shared ``pdserve up`` systems on the same tiny checkpoint (tests/e2e/conftest.py):
disaggregated (two prefill engines of PP=2, one decode engine of TP=1, every request
disaggregated) and ``--colocated`` (one decode engine serving whole requests). Greedy output
must be identical, stop strings must end generation without being returned, and a seeded
sampled request must repeat exactly. The PD stack also serves a second base model of another
shape (issue 48): both answer through the one router, each on its own pools only.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import OTHER_MODEL, SHARED_REFERENCE
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(SHARED_REFERENCE)]

MODEL = "tiny-model"
PROMPTS = ["Hello, world! How are you", "The prefill reads the whole prompt at once, and"]
POOLS = {
    MODEL: ({"prefill-0", "prefill-1"}, {"decode-0"}),
    OTHER_MODEL: ({"prefill-2"}, {"decode-1"}),
}
"""Each base model's prefill and decode engines in the shared PD stack (tests/e2e/conftest.py)."""
METRICS_BOUND_S = 60.0
"""How long an engine's relayed transfer series may lag (each rank sends them every second)."""


def client_of(system: UpSystem) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0)


def greedy(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return raw.parse().choices[0].text, raw.headers["x-pdserve-execution-path"]


def test_greedy_output_through_pd_equals_colocated(
    reference_pd: UpSystem, reference_colocated: UpSystem
) -> None:
    pd_client = client_of(reference_pd)
    pd_outputs = []
    for prompt in PROMPTS:
        text, path = greedy(pd_client, prompt)
        assert path == "disaggregated"
        pd_outputs.append(text)
    colocated_client = client_of(reference_colocated)
    for prompt, expected in zip(PROMPTS, pd_outputs, strict=True):
        text, path = greedy(colocated_client, prompt)
        assert path == "local"
        assert text == expected


def test_stop_string_ends_generation_and_is_not_returned(reference_pd: UpSystem) -> None:
    client = client_of(reference_pd)
    full, _ = greedy(client, PROMPTS[0])
    stop = full[3:6]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    completion = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop]
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]


def test_seeded_sampling_repeats_and_chat_works(reference_pd: UpSystem) -> None:
    client = client_of(reference_pd)
    messages = [{"role": "user", "content": "Tell me about the decode."}]
    texts = set()
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=1234
        )
        assert raw.headers["x-pdserve-execution-path"] == "disaggregated"
        texts.add(raw.parse().choices[0].message.content)
    assert len(texts) == 1


def test_two_base_models_answer_through_one_router_each_on_its_own_pools(
    reference_pd: UpSystem,
) -> None:
    """``pdserve up --model A --model B,...``: ``/v1/models`` lists both, each request runs on
    its model's prefill and decode engines (a prefill never pairs across models: the decode
    engines pulled KV from their own model's prefill engines only), the router counts each
    model's requests under its name, and a name neither serves is vLLM's 404."""
    client = client_of(reference_pd)
    assert [model.id for model in client.models.list()] == [MODEL, OTHER_MODEL]
    counted = "pdserve_router_model_requests_total"
    before = {model: reference_pd.metric(counted, model=model, outcome="ok") for model in POOLS}
    texts = {}
    for model in (MODEL, OTHER_MODEL, OTHER_MODEL, MODEL):
        raw = client.completions.with_raw_response.create(
            model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0
        )
        assert raw.parse().model == model
        assert raw.headers["x-pdserve-execution-path"] == "disaggregated"
        prefills, decodes = POOLS[model]
        assert raw.headers["x-pdserve-prefill-engine"] in prefills
        assert raw.headers["x-pdserve-decode-engine"] in decodes
        texts.setdefault(model, set()).add(raw.parse().choices[0].text)
    assert all(len(answers) == 1 for answers in texts.values())  # greedy: one answer a model
    for model, (prefills, decodes) in POOLS.items():
        assert reference_pd.metric(counted, model=model, outcome="ok") == before[model] + 2
        for decode in decodes:
            assert _producers(reference_pd, decode) <= prefills, (model, decode)
    assert _producers(reference_pd, "decode-1") == POOLS[OTHER_MODEL][0]

    answer = httpx.post(
        f"{reference_pd.url}/v1/completions",
        json={"model": "nobody", "prompt": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": f"The model `nobody` does not exist. Valid aliases: {MODEL}, {OTHER_MODEL}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    router_metrics = httpx.get(f"{reference_pd.url}/metrics", timeout=10).text
    assert 'model="nobody"' not in router_metrics  # no label from a request's text


def _producers(system: UpSystem, decode: str) -> set[str]:
    """The prefill engines ``decode`` pulled KV from (its transfer series' producers), once
    its ranks relayed a first pull."""
    url = system.endpoints["metrics"][decode]
    series = r"^pdserve_kv_transfer_latency_seconds_count\{[^}]*"
    pattern = re.compile(series + r'producer_engine="([^"]+)"')
    deadline = time.monotonic() + METRICS_BOUND_S
    while True:
        text = httpx.get(url, timeout=10).text
        found = {m.group(1) for line in text.splitlines() if (m := pattern.match(line))}
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)

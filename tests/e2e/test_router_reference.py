"""The reference engine through the router: PD (prefill PP=2 -> decode) against colocated.

The two shared ``pdserve up`` systems on the same tiny checkpoint (tests/e2e/conftest.py):
disaggregated (two prefill engines of PP=2, one decode engine of TP=1, every request
disaggregated) and ``--colocated`` (one decode engine serving whole requests). Greedy output
must be identical, stop strings must end generation without being returned, and a seeded
sampled request must repeat exactly.
"""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import SHARED_REFERENCE
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(SHARED_REFERENCE)]

MODEL = "tiny-model"
PROMPTS = ["Hello, world! How are you", "The prefill reads the whole prompt at once, and"]


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

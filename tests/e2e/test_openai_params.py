"""vLLM's OpenAI parameters through ``pdserve up`` (reference engine, disaggregated), with the
official ``openai`` client: defaults a vLLM client sends, penalties and the rest carried
through PD (equal to colocated), ``n``, batched prompts, logprobs, ``echo`` log-likelihood
against ``transformers``, context limits and usage."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from services.tokenization.tokenizer import load_tokenizer
from tests.e2e.conftest import SHARED_REFERENCE
from tests.e2e.up_system import UpSystem
from tests.e2e.vllm_bench import bench_serve_random

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(SHARED_REFERENCE)]

MODEL = "tiny-model"
PROMPT = "Hello, world! How are you"
PENALTIES = {
    "presence_penalty": 2.0,
    "frequency_penalty": 2.0,
    "extra_body": {"repetition_penalty": 3.0, "min_p": 0.05, "min_tokens": 4, "ignore_eos": True},
}
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def pd(reference_pd: UpSystem) -> UpSystem:
    """The shared reference PD stack (tests/e2e/conftest.py): every request disaggregated."""
    return reference_pd


@pytest.fixture(scope="module")
def client(pd: UpSystem) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{pd.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_vllm_client_defaults_are_accepted(pd: UpSystem) -> None:
    # What vLLM's benchmark client and SDKs send: every default spelled out.
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "repetition_penalty": 1.0,
        "logprobs": None,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "min_tokens": 0,
        "n": 1,
        "best_of": 1,
        "ignore_eos": True,
        "stream": False,
        "use_beam_search": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
        "response_format": None,
        "priority": 0,
    }
    response = httpx.post(f"{pd.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_a_sampling_field_the_engines_cannot_carry_is_a_400_naming_it(pd: UpSystem) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "bad_words": ["fox"]}
    response = httpx.post(f"{pd.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "bad_words"


def test_parameter_the_engine_cannot_honour_names_parameter_and_engine(pd: UpSystem) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "structured_outputs": {"choice": ["yes", "no"]}}
    response = httpx.post(f"{pd.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "reference engine" in error["message"]


def test_vllm_validation_errors_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"min_tokens": 3}
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_through_pd_equal_colocated(
    client: openai.OpenAI,
    stream: bool,
    reference_colocated: UpSystem,
) -> None:
    def run(c: openai.OpenAI) -> tuple[str, str]:
        out = []
        for temperature, seed in ((0.0, None), (0.9, 1234)):
            if stream:
                text = "".join(
                    chunk.choices[0].text
                    for chunk in c.completions.create(
                        model=MODEL,
                        prompt=PROMPT,
                        max_tokens=MAX_TOKENS,
                        temperature=temperature,
                        seed=seed,
                        stream=True,
                        **PENALTIES,  # type: ignore[arg-type]
                    )
                    if chunk.choices
                )
            else:
                text = (
                    c.completions.create(
                        model=MODEL,
                        prompt=PROMPT,
                        max_tokens=MAX_TOKENS,
                        temperature=temperature,
                        seed=seed,
                        **PENALTIES,  # type: ignore[arg-type]
                    )
                    .choices[0]
                    .text
                )
            out.append(text)
        return out[0], out[1]

    pd_greedy, pd_seeded = run(client)
    plain = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert pd_greedy != plain.choices[0].text  # the penalties changed something
    if stream:
        return  # the colocated comparison runs once (non-streamed)
    with openai.OpenAI(base_url=f"{reference_colocated.url}/v1", api_key="x", max_retries=0) as c:
        assert run(c) == (pd_greedy, pd_seeded)


def test_logit_bias_forces_a_token(client: openai.OpenAI, model_dir: Path) -> None:
    tokenizer = load_tokenizer(model_dir)
    forced = tokenizer.encode("!", add_special_tokens=False)[0]
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].text == tokenizer.decode([forced] * 5)


@pytest.mark.parametrize("stream", [False, True])
def test_n_and_batched_prompts_with_usage(client: openai.OpenAI, stream: bool) -> None:
    prompts = [PROMPT, "The prefill reads"]
    kwargs = {
        "model": MODEL,
        "prompt": prompts,
        "n": 3,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 7,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        texts: dict[int, str] = {}
        usage = None
        for chunk in client.completions.create(
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,  # type: ignore[arg-type]
        ):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
            usage = chunk.usage or usage
        indices = sorted(texts)
    else:
        completion = client.completions.create(**kwargs)  # type: ignore[arg-type]
        texts = {c.index: c.text for c in completion.choices}
        indices = [c.index for c in completion.choices]
        usage = completion.usage
    assert indices == list(range(6))
    assert usage is not None and usage.completion_tokens == 6 * 5
    single = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert usage.prompt_tokens > single.usage.prompt_tokens  # both prompts, counted once each


def _engines_metric(pd: UpSystem, role: str, name: str) -> float:
    """The sum of ``name``'s samples over every engine of ``role``."""
    total = 0.0
    for engine in pd.endpoints["engines"].values():
        if engine["role"] != role:
            continue
        for line in httpx.get(engine["metrics"], timeout=10).text.splitlines():
            if line.startswith(name):
                total += float(line.rpartition(" ")[2])
    return total


def _texts(client: openai.OpenAI, stream: bool, **kwargs: object) -> list[str]:
    if not stream:
        completion = client.completions.create(**kwargs)  # type: ignore[call-overload]
        return [c.text for c in sorted(completion.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return [texts[i] for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
def test_n_forks_from_one_prefill_and_one_kv_transfer(
    client: openai.OpenAI, pd: UpSystem, stream: bool
) -> None:
    common = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    with pytest.raises(openai.BadRequestError, match="n must be 1 when using greedy sampling"):
        _texts(client, stream, n=3, temperature=0, **common)  # as vLLM's server
    pulls = _engines_metric(pd, "decode", "pdserve_engine_kv_pull_seconds_count")
    forked = pd.metric("pdserve_router_choices_total", path="forked")
    paths = pd.metric("pdserve_router_execution_path_total", path="forked")
    ttfts = pd.metric("pdserve_router_ttft_seconds_count", path="forked")
    phase = "pdserve_router_ttft_phase_seconds_count"
    handoffs = pd.metric(phase, phase="handoff")
    first_decodes = pd.metric(phase, phase="first_decode_token")
    gaps = pd.metric("pdserve_router_itl_seconds_count")
    seeded = _texts(client, stream, n=3, temperature=1.0, seed=11, **common)
    assert _engines_metric(pd, "decode", "pdserve_engine_kv_pull_seconds_count") == pulls + 1
    assert pd.metric("pdserve_router_choices_total", path="forked") == forked + 1
    # Each choice counted and its first token timed, as a single request's (docs/metrics.md).
    assert pd.metric("pdserve_router_execution_path_total", path="forked") == paths + 3
    assert pd.metric("pdserve_router_ttft_seconds_count", path="forked") == ttfts + 3
    # One KV transfer; streamed, each choice's first decode token and gaps (11 decode tokens
    # each, one delta or more a gap), as a single run's; not streamed, neither.
    assert pd.metric(phase, phase="handoff") == handoffs + 1
    assert pd.metric(phase, phase="first_decode_token") == first_decodes + (3 if stream else 0)
    gapped = pd.metric("pdserve_router_itl_seconds_count") - gaps
    if stream:
        assert 3 <= gapped <= 3 * 11
    else:
        assert gapped == 0
    assert _texts(client, stream, n=3, temperature=1.0, seed=11, **common) == seeded
    assert len(set(seeded)) > 1
    # Choice i samples as a request seeded with seed + i (vLLM's rule, and the per-choice path).
    alone = [_texts(client, stream, temperature=1.0, seed=11 + i, **common)[0] for i in range(3)]
    assert seeded == alone


def test_chat_logprobs_and_n(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=2,
        temperature=1.0,  # n > 1 greedy is a 400, as vLLM's server; top_k=1 samples greedily
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True, "top_k": 1},
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content == response.choices[1].message.content
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert response.usage.completion_tokens == 8


def test_echo_logprobs_equal_transformers(client: openai.OpenAI, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2
    )
    choice = completion.choices[0]
    assert choice.text == tokenizer.decode(ids)
    assert choice.logprobs is not None
    got = choice.logprobs.token_logprobs
    assert got[0] is None and len(got) == len(ids)
    assert completion.usage.completion_tokens == 1  # vLLM's server runs (and counts) one
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    expected = [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert got[1:] == pytest.approx(expected, abs=1e-4)
    # A generated token's logprob too (max_tokens=1, echo): PD's first token is the prefill's.
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=0, temperature=0
    )
    lp = scored.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[-1] == pytest.approx(float(logprobs[-1].max()), abs=1e-4)


def test_prompt_logprobs_come_back_through_pd_in_vllm_shape(
    client: openai.OpenAI, model_dir: Path
) -> None:
    """``prompt_logprobs`` (computed on the prefill engine, carried back through PD) as vLLM's
    server renders them: on each completion choice, with or without ``echo`` (then ``logprobs``
    is their count), and once on a chat answer; ``None`` for the first prompt token, then per
    token ``{id: {logprob, rank, decoded_token}}``, the prompt token's own entry first with
    its rank, then the k most likely with ranks 1..k. Before, the field was accepted and
    dropped."""
    ids = load_tokenizer(model_dir).encode(PROMPT, add_special_tokens=True)
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0
    )
    assert scored.choices[0].logprobs is not None
    want = scored.choices[0].logprobs.token_logprobs[1:]  # equal to transformers' (above)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    rendered = (completion.choices[0].model_extra or {})["prompt_logprobs"]
    assert rendered[0] is None and len(rendered) == len(ids)
    for position, token_id, logprob in zip(rendered[1:], ids[1:], want, strict=True):
        own, *others = position.items()
        assert own[0] == str(token_id) and own[1]["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert own[1]["rank"] >= 1 and isinstance(own[1]["decoded_token"], str)
        ranks = [entry["rank"] for _, entry in others]
        assert ranks == [r for r in (1, 2) if r != own[1]["rank"]]
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    assert len((echoed.choices[0].model_extra or {})["prompt_logprobs"]) == len(ids)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    assert chat.usage is not None
    chat_rendered = (chat.model_extra or {})["prompt_logprobs"]
    assert chat_rendered[0] is None and len(chat_rendered) == chat.usage.prompt_tokens


def test_streamed_logprobs_equal_non_streamed(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kwargs).choices[0].logprobs  # type: ignore[arg-type]
    assert whole is not None and len(whole.tokens) == 6
    tokens: list[str] = []
    logprobs: list[float | None] = []
    for chunk in client.completions.create(stream=True, **kwargs):  # type: ignore[arg-type]
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens.extend(choice.logprobs.tokens)
                logprobs.extend(choice.logprobs.token_logprobs)
    assert tokens == whole.tokens
    assert logprobs == pytest.approx(whole.token_logprobs, abs=1e-6)
    # The 2 most likely and the sampled one (the same, greedy), keyed by text as vLLM does:
    # two ids whose text is the same (an incomplete character) share an entry.
    assert all(top and 1 <= len(top) <= 3 for top in whole.top_logprobs)


def test_prefix_cache_serves_a_repeated_prompt_with_the_same_output(
    client: openai.OpenAI,
) -> None:
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens: " * 2
    kwargs = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    first = client.completions.create(**kwargs)  # type: ignore[arg-type]
    second = client.completions.create(**kwargs)  # type: ignore[arg-type]
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_context_limit_is_a_400(pd: UpSystem, model_dir: Path) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100_000}
    response = httpx.post(f"{pd.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "max_model_len" in response.json()["error"]["message"]


def test_vllm_bench_serve_random_dataset_has_no_failed_request(
    pd: UpSystem, model_dir: Path, tmp_path: Path
) -> None:
    result = bench_serve_random(pd.url, MODEL, model_dir, tmp_path, num_prompts=20, output_len=8)
    assert (result["completed"], result["failed"]) == (20, 0)
    assert result["total_output_tokens"] == 20 * 8
    assert result["router_failed"] == 0

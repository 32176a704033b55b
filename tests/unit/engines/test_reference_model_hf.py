"""The reference model against transformers on the same tiny checkpoints.

Tolerance: float32 everywhere, ``atol = rtol = 1e-4`` on logits (observed differences are
below 1e-5 for Llama and ~2e-5 for Qwen2 with TP, on logits of magnitude ~4-10). Greedy tokens
must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from services.engines.reference.batch import SequenceChunk
from services.engines.reference.config import ModelConfig
from services.engines.reference.layers import rope_inverse_frequencies

ATOL = RTOL = 1e-4
DECODE_STEPS = 6
PROMPT = [0, *range(40, 75)]  # BOS + 35 tokens: spans 9 blocks of 4


@pytest.fixture(scope="module")
def hf_models(tiny_llama: Path, tiny_qwen2: Path) -> dict[str, torch.nn.Module]:
    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, path in (("llama", tiny_llama), ("qwen2", tiny_qwen2))
    }


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", [(1, 1), (2, 2)], ids=["unsharded", "pp2xtp2"])
def test_prefill_and_greedy_decode_match_transformers(
    variant, layout, hf_models, tiny_llama, tiny_qwen2, make_group, greedy
):
    directory = tiny_llama if variant == "llama" else tiny_qwen2
    hf = hf_models[variant]
    group = make_group(directory, *layout)

    tokens, logits = greedy(group, PROMPT, DECODE_STEPS)

    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT + tokens])).logits[0]
    torch.testing.assert_close(logits[0], expected[: len(PROMPT)], atol=ATOL, rtol=RTOL)
    for step, step_logits in enumerate(logits[1:]):
        # Decode step `step` fed token `step` at position len(PROMPT) + step.
        torch.testing.assert_close(step_logits, expected[len(PROMPT) + step], atol=ATOL, rtol=RTOL)
    hf_tokens = expected[len(PROMPT) - 1 : -1].argmax(-1).tolist()
    assert tokens == hf_tokens


def test_chunked_prefill_matches_one_shot_prefill(tiny_llama, make_group, hf_models):
    group = make_group(tiny_llama)
    table = (5, 9, 1, 30, 2, 7, 11, 13, 22, 3)
    pieces = [PROMPT[:7], PROMPT[7:8], PROMPT[8:21], PROMPT[21:]]
    chunk_logits = []
    done = 0
    for piece in pieces:
        chunk_logits.append(group.step([SequenceChunk(tuple(piece), done, table)], all_tokens=True))
        done += len(piece)

    with torch.no_grad():
        expected = hf_models["llama"](torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(torch.cat(chunk_logits), expected, atol=ATOL, rtol=RTOL)


def test_mixed_prefill_and_decode_batch_matches_separate_runs(tiny_llama, make_group):
    """One step holding a decode token of sequence A and a prefill chunk of sequence B gives the
    same logits as running each alone."""
    table_a, table_b = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9), (20, 21, 22, 23, 24, 25, 26, 27)
    prompt_a, prompt_b = PROMPT[:13], [0, *range(100, 120)]
    separate = make_group(tiny_llama)
    separate.step([SequenceChunk(tuple(prompt_a), 0, table_a)])
    alone_a = separate.step([SequenceChunk((77,), len(prompt_a), table_a)])
    alone_b = separate.step([SequenceChunk(tuple(prompt_b), 0, table_b)], all_tokens=True)

    mixed = make_group(tiny_llama)
    mixed.step([SequenceChunk(tuple(prompt_a), 0, table_a)])
    both = mixed.step(
        [
            SequenceChunk((77,), len(prompt_a), table_a),
            SequenceChunk(tuple(prompt_b), 0, table_b),
        ],
        all_tokens=True,
    )

    torch.testing.assert_close(both[:1], alone_a, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(both[1:], alone_b, atol=ATOL, rtol=RTOL)


def test_batched_decode_of_sequences_at_different_lengths(tiny_llama, make_group, hf_models):
    """Three sequences of different context lengths decode together in one step."""
    group = make_group(tiny_llama)
    prompts = [PROMPT[:5], PROMPT, PROMPT[:18]]
    tables = [tuple(range(start, start + 12)) for start in (0, 12, 24)]
    for prompt, table in zip(prompts, tables, strict=True):
        group.step([SequenceChunk(tuple(prompt), 0, table)])
    logits = group.step(
        [
            SequenceChunk((90 + index,), len(prompt), table)
            for index, (prompt, table) in enumerate(zip(prompts, tables, strict=True))
        ]
    )
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf_models["llama"](torch.tensor([[*prompt, 90 + index]])).logits[0, -1]
        torch.testing.assert_close(logits[index], expected, atol=ATOL, rtol=RTOL)


def test_llama3_rope_frequencies_match_transformers(tiny_llama):
    config = ModelConfig.from_directory(tiny_llama)
    hf_config = LlamaConfig.from_pretrained(tiny_llama)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))

    ours = rope_inverse_frequencies(config)

    torch.testing.assert_close(ours, expected.to(torch.float32))
    # The tiny model's settings put frequencies in all three bands (kept, smoothed, scaled).
    dim = config.head_dim
    plain = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    ratio = plain / ours
    assert ratio.min() == pytest.approx(1.0)
    assert ratio.max() == pytest.approx(8.0)
    assert ((ratio > 1.01) & (ratio < 7.99)).any()

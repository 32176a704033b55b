"""Sampling and output text of the reference engine (pure functions, no processes)."""

from __future__ import annotations

import torch

from services.engines.backend import SamplingParams
from services.engines.reference.sampling import OutputText, make_generator, sample_token
from services.engines.reference.tokenizer import ByteTokenizer


def test_greedy_takes_the_argmax_and_draws_nothing() -> None:
    generator = make_generator(7)
    state = generator.get_state()
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert sample_token(logits, SamplingParams(), generator) == 1
    assert torch.equal(generator.get_state(), state)


def test_seeded_sampling_repeats_and_top_k_top_p_restrict_the_choice() -> None:
    logits = torch.tensor([2.0, 1.9, 1.8, -5.0, -5.0])
    params = SamplingParams(temperature=1.0, seed=3)
    first = [sample_token(logits, params, make_generator(3)) for _ in range(5)]
    assert len(set(first)) == 1  # same seed, same draw
    top1 = SamplingParams(temperature=5.0, top_k=1, seed=1)
    gen = make_generator(1)
    assert {sample_token(logits, top1, gen) for _ in range(50)} == {0}
    nucleus = SamplingParams(temperature=1.0, top_p=0.5, seed=2)
    gen = make_generator(2)
    assert {sample_token(logits, nucleus, gen) for _ in range(200)} <= {0, 1}


def _ids(tokenizer: ByteTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_stop_string_is_held_back_then_cut() -> None:
    tokenizer = ByteTokenizer()
    out = OutputText(tokenizer, ["END"])
    released = "".join(out.add(t) for t in _ids(tokenizer, "abcEN"))
    assert released == "abc"  # "EN" could start "END"
    assert out.add(_ids(tokenizer, "D")[0]) == ""
    assert out.stopped and out.text == "abc"


def test_false_stop_prefix_is_released_and_multibyte_waits() -> None:
    tokenizer = ByteTokenizer()
    out = OutputText(tokenizer, ["END"])
    assert "".join(out.add(t) for t in _ids(tokenizer, "xENx")) == "xENx"
    euro = _ids(tokenizer, "€")
    assert [out.add(t) for t in euro] == ["", "", "€"]
    assert out.flush() == "" and not out.stopped


def test_already_released_text_counts_for_stops_but_is_not_repeated() -> None:
    tokenizer = ByteTokenizer()
    first, *rest = _ids(tokenizer, "E!ND")
    out = OutputText(tokenizer, ["END"], already_released=[first])
    assert [out.add(t) for t in rest] == ["!", "N", "D"]
    assert not out.stopped

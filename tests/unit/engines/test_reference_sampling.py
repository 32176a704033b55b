"""Sampling and output text of the reference engine (pure functions, no processes)."""

from __future__ import annotations

import torch

from services.engines.reference.sampling import (
    OutputText,
    make_generator,
    sample_token,
    token_generator,
)
from services.engines.requests import SamplingParams
from services.tokenization.tokenizer import ByteTokenizer


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


def test_an_incomplete_character_at_the_end_is_released_or_not_by_the_engine_rule() -> None:
    tokenizer = ByteTokenizer()
    euro = _ids(tokenizer, "€")
    for incomplete in (True, False):
        out = OutputText(tokenizer, ["END"])
        assert "".join(out.add(t) for t in [*_ids(tokenizer, "abEN"), *euro[:2]]) == "ab"
        # "EN" was held as a possible stop, the two bytes as an incomplete character: the stop
        # prefix is released either way, the character only by the reference engine's rule
        # (vLLM's text ends before it).
        out.flush(incomplete=incomplete)
        assert out.text.rstrip("\ufffd") == "abEN"
        assert out.text.endswith("\ufffd") is incomplete


def test_already_released_tokens_count_for_stops_and_release_held_text_once() -> None:
    tokenizer = ByteTokenizer()
    first, *rest = _ids(tokenizer, "E!ND")
    out = OutputText(tokenizer, ["END"], already_released=[first])
    # The producer held "E" back (a possible "END"), so the consumer releases it with "!".
    assert [out.add(t) for t in rest] == ["E!", "N", "D"]
    assert not out.stopped


def test_replayed_first_token_releases_held_text_where_colocated_would() -> None:
    tokenizer = ByteTokenizer()
    ids = _ids(tokenizer, "EN!")
    colocated = OutputText(tokenizer, ["END"])
    colocated_pieces = [colocated.add(t) for t in ids]
    assert colocated_pieces == ["", "", "EN!"]  # "E", then "EN" held as a possible "END"
    # The producer released nothing for "E"; the consumer replays it and releases the same.
    consumer = OutputText(tokenizer, ["END"], already_released=ids[:1])
    assert [consumer.add(t) for t in ids[1:]] == colocated_pieces[1:]
    assert consumer.text == "EN!"


def test_token_generator_depends_on_seed_and_position_only() -> None:
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, seed=5)
    draws = [sample_token(logits, params, token_generator(5, i)) for i in range(8)]
    assert draws == [sample_token(logits, params, token_generator(5, i)) for i in range(8)]
    assert len(set(draws)) > 1  # positions differ
    assert draws != [sample_token(logits, params, token_generator(6, i)) for i in range(8)]


def test_penalties_bias_and_min_tokens_follow_vllm() -> None:
    import torch  # noqa: PLC0415

    from services.engines.reference.sampling import process_logits  # noqa: PLC0415
    from services.engines.requests import SamplingParams  # noqa: PLC0415

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    params = SamplingParams(
        max_tokens=8,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias=((4, 1.5),),
        min_tokens=3,
    )
    out = process_logits(logits, params, prompt=[1], output=[0, 0, 2], stop_ids=[3])
    # bias: token 4 + 1.5; min_tokens: stop id 3 masked (3 outputs is not yet > 3... < 3 false)
    expected = torch.tensor(
        [
            2.0 / 2 - 0.25 * 2 - 0.5,  # in output twice: repetition, frequency x2, presence
            -1.0 * 2,  # in the prompt: repetition only (negative logit is multiplied)
            0.5 / 2 - 0.25 - 0.5,
            3.0,  # min_tokens reached (3 outputs): not masked
            2.5,
        ]
    )
    torch.testing.assert_close(out, expected)
    early = process_logits(logits, params, prompt=[1], output=[0], stop_ids=[3])
    assert early[3] == float("-inf")


def test_min_p_drops_unlikely_tokens() -> None:
    import torch  # noqa: PLC0415

    from services.engines.reference.sampling import make_generator, sample_token  # noqa: PLC0415
    from services.engines.requests import SamplingParams  # noqa: PLC0415

    logits = torch.tensor([5.0, 0.0, 4.9, -3.0])
    params = SamplingParams(temperature=1.0, min_p=0.5)
    picks = {sample_token(logits, params, make_generator(seed)) for seed in range(200)}
    assert picks == {0, 2}


def test_a_continuation_penalizes_its_prompts_output_as_an_unbroken_run() -> None:
    """The router's next leg (``output_tokens_in_prompt``): the prompt's last tokens are the
    output of earlier legs, penalized as output exactly as in the unbroken request."""
    from dataclasses import replace  # noqa: PLC0415

    from services.engines.reference.sampling import process_logits  # noqa: PLC0415

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    params = SamplingParams(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    unbroken = process_logits(logits, params, prompt=[1], output=[0, 2, 0, 4], stop_ids=[])
    continued = replace(params, max_tokens=6, output_tokens_in_prompt=2)
    got = process_logits(logits, continued, prompt=[1, 0, 2], output=[0, 4], stop_ids=[])
    torch.testing.assert_close(got, unbroken)
    as_prompt = process_logits(logits, params, prompt=[1, 0, 2], output=[0, 4], stop_ids=[])
    assert not torch.allclose(as_prompt, unbroken)  # what the field is for

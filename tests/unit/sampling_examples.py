"""Sampling parameters the conversion tests share."""

from __future__ import annotations

from services.engines.requests import SamplingParams

EVERY_FIELD_SET = SamplingParams(
    max_tokens=9,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    seed=7,
    stop=("end",),
    stop_token_ids=(5,),
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.2,
    min_p=0.05,
    min_tokens=2,
    logit_bias=((3, -100.0), (9, 2.5)),
    logprobs=2,
    prompt_logprobs=0,
    include_stop_str_in_output=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    n=3,
    output_tokens_in_prompt=4,
    structured_outputs='{"choice":["a","b"]}',
)
"""Every field set to a value other than its default (the round trips' fixed case)."""

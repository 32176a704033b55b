"""Output that vLLM sees as prompt, in its frequency and presence penalties.

Imports vLLM: loaded by vLLM's engine core from ``OUTPUT_IN_PROMPT_PENALTIES`` (the backend's
``AsyncEngineArgs.logits_processors``), never by the services.

Two kinds of pdserve request hand vLLM output tokens as prompt tokens
(services.engines.vllm.request_mapping): a disaggregated decode continues after the producer's
first token by taking it as its last prompt token, and a continuation (the router's next leg of
a request that broke on another engine, ``SamplingParams.output_tokens_in_prompt``) carries the
tokens produced so far at its prompt's end. vLLM's repetition penalty covers them either way
(prompt and output), but its frequency and presence penalties (output only) do not: a colocated,
unbroken request counts them as output. :class:`OutputInPromptPenalties` makes up the
difference for requests whose ``SamplingParams.extra_args`` carry ``OUTPUT_IN_PROMPT_ARG`` (those
token ids): for each such token ``t``, counted ``c`` times there, the final logit is what vLLM's
colocated penalties would give,

    rep(x) - frequency_penalty * (c + count) - presence_penalty

where ``count`` is its count in vLLM's output so far and ``rep`` the repetition penalty that
applies to it anyway. vLLM runs non-argmax-invariant logits processors before its penalties,
so the processor writes ``rep⁻¹(rep(x) - frequency_penalty * c - presence_penalty * [count == 0])``:
after vLLM's own penalties the logit is exactly the colocated one (up to float rounding).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from services.engines.vllm import seeded_draws
from services.engines.vllm.request_mapping import OUTPUT_IN_PROMPT_ARG

if TYPE_CHECKING:
    from vllm.config import VllmConfig


_State = tuple[tuple[tuple[int, int], ...], float, float, float, list[int]]
"""((token, count in the prompt's output), frequency, presence, repetition penalty, the live
output token list)."""


class OutputInPromptPenalties(LogitsProcessor):
    """See the module docstring. Built in every worker process of such an engine, it also
    installs :mod:`services.engines.vllm.seeded_draws` there (seeded decodes and continuations
    continue the random stream of the tokens before them)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._requests: dict[int, _State] = {}
        seeded_draws.install()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._requests, batch_update, _state_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (counted, frequency, presence, repetition, output) in self._requests.items():
            seen = set(output)
            for token, count in counted:
                penalty = frequency * count + (presence if token not in seen else 0.0)
                x = logits[index, token]
                penalized = x / repetition if x > 0 else x * repetition
                target = penalized - penalty
                logits[index, token] = target * repetition if target > 0 else target / repetition
        return logits


def _state_of(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> Any:
    extra = params.extra_args or {}
    tokens = extra.get(OUTPUT_IN_PROMPT_ARG)
    if not tokens or not (params.frequency_penalty or params.presence_penalty):
        return None
    return (
        tuple(sorted(Counter(int(token) for token in tokens).items())),
        float(params.frequency_penalty),
        float(params.presence_penalty),
        float(params.repetition_penalty),
        output,
    )

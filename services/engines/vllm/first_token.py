"""The producer's first token in a vLLM decode's frequency and presence penalties.

Imports vLLM: loaded by vLLM's engine core from ``FIRST_TOKEN_PENALTIES`` (the backend's
``AsyncEngineArgs.logits_processors``), never by the services.

A disaggregated vLLM decode continues after the producer's first token by taking it as the last
prompt token (services.engines.vllm.request_mapping), so vLLM's repetition penalty covers it (prompt
and output) but its frequency and presence penalties (output only) do not: a colocated request
counts it as output. :class:`FirstTokenPenalties` makes up the difference for requests whose
``SamplingParams.extra_args`` carry ``FIRST_TOKEN_ARG`` (the first token id): the first token's
final logit is what vLLM's colocated penalties would give,

    rep(x) - frequency_penalty * (count + 1) - presence_penalty

where ``count`` is its count in the output so far and ``rep`` the repetition penalty that
applies to it anyway. vLLM runs non-argmax-invariant logits processors before its penalties,
so the processor writes ``rep⁻¹(rep(x) - frequency_penalty - presence_penalty * [count == 0])``:
after vLLM's own penalties the logit is exactly the colocated one (up to float rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from services.engines.vllm import seeded_draws
from services.engines.vllm.request_mapping import FIRST_TOKEN_ARG

if TYPE_CHECKING:
    from vllm.config import VllmConfig


_State = tuple[int, float, float, float, list[int]]
"""(first token, frequency, presence, repetition penalty, the live output token list)."""


class FirstTokenPenalties(LogitsProcessor):
    """See the module docstring. Built in every worker process of such an engine, it also
    installs :mod:`services.engines.vllm.seeded_draws` there (seeded decodes continue the
    producer's generator)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._requests: dict[int, _State] = {}
        seeded_draws.install()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._requests, batch_update, _state_of)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (token, frequency, presence, repetition, output) in self._requests.items():
            penalty = frequency + (presence if token not in output else 0.0)
            x = logits[index, token]
            penalized = x / repetition if x > 0 else x * repetition
            target = penalized - penalty
            logits[index, token] = target * repetition if target > 0 else target / repetition
        return logits


def _state_of(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> Any:
    extra = params.extra_args or {}
    token = extra.get(FIRST_TOKEN_ARG)
    if token is None or not (params.frequency_penalty or params.presence_penalty):
        return None
    return (
        int(token),
        float(params.frequency_penalty),
        float(params.presence_penalty),
        float(params.repetition_penalty),
        output,
    )

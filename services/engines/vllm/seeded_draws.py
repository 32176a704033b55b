"""A seeded vLLM decode continues the producer's random stream instead of restarting it.

Imports vLLM: installed in vLLM's worker processes by :class:`OutputInPromptPenalties` (the
logits processor every vLLM engine without speculative decoding is built with), never by the
services.

vLLM 0.32.0's V1 model runner (the runner on CPUs, and wherever the V2 runner is unsupported)
gives a seeded request its own ``torch.Generator``, created in
``GPUModelRunner._update_states`` when the request first reaches the runner and seeded with
``SamplingParams.seed``; its sampler (``TopKTopPSampler``) makes one draw from it per sampled
token. A disaggregated decode is a new request to vLLM, so its generator starts afresh and its
first sample repeats the draw the producer already made for the first token: the text differs
from colocated vLLM's. The decode request carries, in ``SamplingParams.extra_args``,
``SAMPLED_TOKENS_ARG``: how many tokens were sampled before it (the producer's first token, and
a continuation's tokens from earlier legs, which its prefill skips too); :func:`install` wraps
``_update_states`` so that a request created with it gets its generator advanced by that many
draws, each made by the runner's own sampler on a row as wide as the vocabulary (the draw a
sampled token costs on this platform: a ``randint`` on CPUs, an ``exponential_`` over the row
with PyTorch's native sampler). The decode then samples its first token with the second draw,
as colocated vLLM does.

The V2 model runner (``vllm/v1/worker/gpu/``, vLLM's default on GPUs) keys its Gumbel noise by
(seed, position) with no generator state, so a decode's sample at a position equals
colocated's without help; it is not patched. Speculative decoding (the rejection sampler draws
differently, and vLLM refuses the logits processor that installs this) keeps the difference.
``tests/unit/vllm/test_seeded_draws.py`` fails if the internals used here change.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from services.engines.vllm.request_mapping import SAMPLED_TOKENS_ARG

logger = logging.getLogger(__name__)

_INSTALLED = "_pdserve_seeded_draws"


def sampled_tokens(sampling_params: Any) -> int:
    """How many draws a new request's generator must skip (0 when none)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return max(0, int(extra.get(SAMPLED_TOKENS_ARG) or 0))


def advance(sampler: Any, generator: torch.Generator, draws: int, vocab_size: int) -> None:
    """Advance ``generator`` by ``draws`` of ``sampler``'s (a ``TopKTopPSampler``) draws, each
    what sampling one token of a ``vocab_size``-wide row costs."""
    for _ in range(draws):
        logits = torch.zeros((1, vocab_size), dtype=torch.float32, device=generator.device)
        sampler.forward(logits, {0: generator}, None, None)


def advancing(update_states: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner._update_states`` that advances the generators it creates for requests
    carrying :data:`SAMPLED_TOKENS_ARG` (see the module docstring)."""

    @functools.wraps(update_states)
    def _update_states(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # Requests the runner already holds (vLLM's streaming input) keep their generator.
        created = [
            new
            for new in scheduler_output.scheduled_new_reqs
            if new.req_id not in self.requests and sampled_tokens(new.sampling_params)
        ]
        result = update_states(self, scheduler_output, *args, **kwargs)
        for new in created:
            state = self.requests.get(new.req_id)
            if state is not None and state.generator is not None:
                advance(
                    self.sampler.topk_topp_sampler,
                    state.generator,
                    sampled_tokens(new.sampling_params),
                    self.input_batch.vocab_size,
                )
        return result

    setattr(_update_states, _INSTALLED, True)
    return _update_states


def install() -> None:
    """Wrap vLLM's V1 ``GPUModelRunner._update_states`` once per process (its CPU runner
    inherits it)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415

    if getattr(GPUModelRunner._update_states, _INSTALLED, False):
        return
    GPUModelRunner._update_states = advancing(GPUModelRunner._update_states)
    logger.debug("seeded decodes continue the producer's generator (V1 model runner)")

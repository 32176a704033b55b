"""The producer's first token in a disaggregated vLLM decode's frequency and presence
penalties: vLLM's real penalty code, with the logits processor, gives the colocated logits."""

from __future__ import annotations

import pytest
import torch

from services.engines.backend import SamplingParams
from services.engines.vllm.request_mapping import FIRST_TOKEN_ARG, decode_sampling

VOCAB = 32
PROMPT = [3, 4, 5]
FIRST = 7  # the producer's first token
OUTPUT = [9, 7, 9]  # what the decode generated after it (FIRST again included)


def _penalized(logits: torch.Tensor, params: object, prompt: list[int], output: list[int]):
    from vllm.model_executor.layers.utils import apply_penalties  # noqa: PLC0415

    return apply_penalties(
        logits.clone().unsqueeze(0),
        torch.tensor([prompt]),
        torch.tensor([output or [VOCAB]]),  # vocab_size pads (an empty output)
        torch.tensor([params.presence_penalty]),  # type: ignore[attr-defined]
        torch.tensor([params.frequency_penalty]),  # type: ignore[attr-defined]
        torch.tensor([params.repetition_penalty]),  # type: ignore[attr-defined]
    )[0]


# vLLM's and torch's import-time deprecations (as tests/integration/engines/test_bench_engine).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("output", [[], OUTPUT])
def test_first_token_penalties_give_the_colocated_logits(output: list[int]) -> None:
    from vllm import SamplingParams as VllmSamplingParams  # noqa: PLC0415
    from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: PLC0415

    from services.engines.vllm.first_token import FirstTokenPenalties  # noqa: PLC0415

    sampling = SamplingParams(
        max_tokens=8, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.5
    )
    assert "extra_args" not in decode_sampling(sampling, None, FIRST)  # only with a handle
    params = VllmSamplingParams(
        max_tokens=8,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.5,
        extra_args={FIRST_TOKEN_ARG: FIRST},
    )
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 3
    logits[FIRST] = 2.0
    colocated = _penalized(logits, params, PROMPT, [FIRST, *output])
    processor = FirstTokenPenalties(None, torch.device("cpu"), False)
    live_output = list(output)
    processor.update_state(BatchUpdate(1, [], [(0, params, [*PROMPT, FIRST], live_output)], []))
    adjusted = processor.apply(logits.clone().unsqueeze(0))[0]
    disaggregated = _penalized(adjusted, params, [*PROMPT, FIRST], live_output)
    torch.testing.assert_close(disaggregated, colocated)
    # Without the processor the first token's logit differs (what it fixes).
    assert not torch.allclose(_penalized(logits, params, [*PROMPT, FIRST], live_output), colocated)

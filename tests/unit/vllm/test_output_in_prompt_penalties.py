"""Output that vLLM sees as prompt (a disaggregated decode's first token, a continuation's
tokens so far) in its frequency and presence penalties: vLLM's real penalty code, with the
logits processor, gives the colocated (unbroken) logits."""

from __future__ import annotations

import pytest
import torch

from services.engines.requests import SamplingParams
from services.engines.vllm.request_mapping import OUTPUT_IN_PROMPT_ARG, decode_sampling

VOCAB = 32
PROMPT = [3, 4, 5]
FIRST = 7  # the producer's first token
OUTPUT = [9, 7, 9]  # what the decode generated after it (FIRST again included)
EARLIER = [7, 9, 7, 2]  # a continuation's output from earlier legs (FIRST and 9 among them)


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
@pytest.mark.parametrize("earlier", [[], EARLIER], ids=["first-leg", "continuation"])
@pytest.mark.parametrize("output", [[], OUTPUT], ids=["no-output", "output"])
def test_output_in_prompt_penalties_give_the_colocated_logits(
    output: list[int], earlier: list[int]
) -> None:
    from vllm import SamplingParams as VllmSamplingParams  # noqa: PLC0415
    from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: PLC0415

    from services.engines.vllm.output_in_prompt import OutputInPromptPenalties  # noqa: PLC0415

    sampling = SamplingParams(
        max_tokens=8,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.5,
        output_tokens_in_prompt=len(earlier),
    )
    prompt = [*PROMPT, *earlier]  # the leg's prompt
    if not earlier:  # only with a handle
        assert "extra_args" not in decode_sampling(sampling, tuple(prompt), None, FIRST)
    carried = [*earlier, FIRST]
    extra = decode_sampling(sampling, tuple(prompt), None, FIRST).get("extra_args", {})
    assert extra.get(OUTPUT_IN_PROMPT_ARG, []) == earlier  # locally: no producer's token
    params = VllmSamplingParams(
        max_tokens=8,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        repetition_penalty=1.5,
        extra_args={OUTPUT_IN_PROMPT_ARG: carried},
    )
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 3
    logits[FIRST] = 2.0
    logits[2] = -1.5
    colocated = _penalized(logits, params, PROMPT, [*carried, *output])
    processor = OutputInPromptPenalties(None, torch.device("cpu"), False)
    live_output = list(output)
    vllm_prompt = [*prompt, FIRST]
    processor.update_state(BatchUpdate(1, [], [(0, params, vllm_prompt, live_output)], []))
    adjusted = processor.apply(logits.clone().unsqueeze(0))[0]
    disaggregated = _penalized(adjusted, params, vllm_prompt, live_output)
    torch.testing.assert_close(disaggregated, colocated)
    # Without the processor the carried tokens' logits differ (what it fixes).
    assert not torch.allclose(_penalized(logits, params, vllm_prompt, live_output), colocated)

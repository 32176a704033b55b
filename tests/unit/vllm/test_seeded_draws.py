"""A seeded disaggregated vLLM decode continues the producer's generator: vLLM's real sampler
and model-runner code; fails when the vLLM internals ``seeded_draws`` relies on change."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from services.engines.vllm.request_mapping import SAMPLED_TOKENS_ARG

VOCAB = 64
SEED = 1234

pytestmark = [
    # vLLM's and torch's import-time deprecations (as test_first_token_penalties).
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _sampler() -> Any:
    """The sampler vLLM's worker builds on this platform (on CPUs: ``forward_cpu``, whose
    Gumbel kernel the platform's kernels provide, as in a worker)."""
    from vllm.platforms import current_platform  # noqa: PLC0415
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler  # noqa: PLC0415

    current_platform.import_kernels()
    return TopKTopPSampler()


def _sample(sampler: Any, logits: torch.Tensor, generator: torch.Generator, k: Any, p: Any) -> int:
    tokens, _ = sampler.forward(logits.clone(), {0: generator}, k, p)
    return int(tokens[0])


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [
        (None, None),
        (torch.tensor([8]), None),
        (None, torch.tensor([0.8])),
        (torch.tensor([8]), torch.tensor([0.8])),
    ],
)
def test_an_advanced_generator_samples_what_colocated_samples_next(top_k: Any, top_p: Any) -> None:
    from services.engines.vllm.seeded_draws import advance  # noqa: PLC0415

    sampler = _sampler()
    steps = [torch.randn((1, VOCAB), generator=torch.Generator().manual_seed(n)) for n in range(6)]
    colocated = torch.Generator().manual_seed(SEED)
    expected = [_sample(sampler, logits, colocated, top_k, top_p) for logits in steps]
    decode = torch.Generator().manual_seed(SEED)  # a fresh generator: the decode's
    advance(sampler, decode, 1, VOCAB)  # the producer sampled steps[0]
    assert [_sample(sampler, logits, decode, top_k, top_p) for logits in steps[1:]] == expected[1:]
    assert torch.equal(decode.get_state(), colocated.get_state())
    restarted = torch.Generator().manual_seed(SEED)  # without advancing: the known difference
    _sample(sampler, steps[1], restarted, top_k, top_p)
    assert not torch.equal(restarted.get_state(), torch.Generator().manual_seed(SEED).get_state())
    assert not torch.equal(restarted.get_state(), decode.get_state())


def _runner(sampler: Any) -> SimpleNamespace:
    return SimpleNamespace(
        requests={},
        sampler=SimpleNamespace(topk_topp_sampler=sampler),
        input_batch=SimpleNamespace(vocab_size=VOCAB),
    )


def _new(req_id: str, extra: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(extra_args=extra))


def test_update_states_advances_only_new_requests_that_carry_the_count() -> None:
    from services.engines.vllm.seeded_draws import advancing  # noqa: PLC0415

    def create(self: Any, scheduler_output: Any) -> str:
        """vLLM's part: a seeded generator per new request (none for request c: unseeded)."""
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self.requests:
                generator = None if new.req_id == "c" else torch.Generator().manual_seed(SEED)
                self.requests[new.req_id] = SimpleNamespace(generator=generator)
        return "result"

    runner = _runner(_sampler())
    runner.requests["d"] = SimpleNamespace(generator=torch.Generator().manual_seed(SEED))
    new = [_new("a", {SAMPLED_TOKENS_ARG: 1}), _new("b", None), _new("c", {SAMPLED_TOKENS_ARG: 1})]
    new.append(_new("d", {SAMPLED_TOKENS_ARG: 1}))  # already held (streaming input): untouched
    assert advancing(create)(runner, SimpleNamespace(scheduled_new_reqs=new)) == "result"
    fresh = torch.Generator().manual_seed(SEED).get_state()
    assert not torch.equal(runner.requests["a"].generator.get_state(), fresh)
    assert torch.equal(runner.requests["b"].generator.get_state(), fresh)
    assert runner.requests["c"].generator is None
    assert torch.equal(runner.requests["d"].generator.get_state(), fresh)


def test_vllm_internals_seeded_draws_relies_on() -> None:
    """vLLM 0.32.0's V1 runner creates a request's generator in ``_update_states`` from
    ``scheduled_new_reqs`` and holds it in ``requests[req_id].generator``; its sampler draws
    from ``sampler.topk_topp_sampler`` with a ``{row: generator}`` dict; the vocabulary width
    is ``input_batch.vocab_size``. A change to any of these fails here, not silently in PD."""
    from vllm.v1.sample.sampler import Sampler  # noqa: PLC0415
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch  # noqa: PLC0415
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415

    from services.engines.vllm.seeded_draws import install  # noqa: PLC0415

    update_states = inspect.getsource(inspect.unwrap(GPUModelRunner._update_states))
    assert "for new_req_data in scheduler_output.scheduled_new_reqs:" in update_states
    assert "generator.manual_seed(sampling_params.seed)" in update_states
    assert "self.requests[req_id] = req_state" in update_states
    assert "generator" in CachedRequestState.__dataclass_fields__
    assert "self.vocab_size = vocab_size" in inspect.getsource(InputBatch.__init__)
    sampler_source = inspect.getsource(Sampler)
    assert "self.topk_topp_sampler(" in sampler_source
    assert "sampling_metadata.generators," in sampler_source
    assert "self.sampler = Sampler(" in inspect.getsource(GPUModelRunner.__init__)
    install()
    install()  # once per process
    wrapped = GPUModelRunner._update_states
    assert getattr(wrapped, "_pdserve_seeded_draws", False)
    assert not getattr(wrapped.__wrapped__, "_pdserve_seeded_draws", False)  # type: ignore[attr-defined]

"""The text of a migrated request (services/router/execution/executor.py, Progress)."""

from __future__ import annotations

import pytest

from services.engines.requests import FinishReason, SamplingParams
from services.router.execution.executor import Progress
from services.router.execution.migration import Step
from services.tokenization.tokenizer import ByteTokenizer


def test_a_continuation_on_synthetic_engines_keeps_their_text() -> None:
    """Sim and stub token ids run past the byte tokenizer's vocabulary; their text is one word
    per token, so the continuation sends the engine's text as an unbroken run would."""
    progress = Progress((1, 2, 3), SamplingParams(max_tokens=4))
    progress.engine_kind = "sim"
    assert progress.add(Step((762,), " t762")) == (" t762", None)
    progress.next_leg(ByteTokenizer())  # failed with "token id 762 outside the vocabulary"
    progress.engine_kind = "sim"
    assert progress.prompt() == (1, 2, 3, 762)
    assert progress.add(Step((763, 764, 765), " t763 t764 t765", FinishReason.LENGTH)) == (
        " t763 t764 t765",
        FinishReason.LENGTH,
    )


def test_a_continuation_on_a_real_engine_is_detokenized_by_the_router() -> None:
    progress = Progress((1,), SamplingParams(max_tokens=4))
    progress.engine_kind = "reference"
    progress.add(Step((ord("h"),), "h"))
    progress.next_leg(ByteTokenizer())
    progress.engine_kind = "reference"
    # The engine's text is not used: the router's own detokenization of the whole output is.
    text, finish = progress.add(Step((ord("i"),), "engine text", FinishReason.LENGTH))
    assert (text, finish) == ("i", FinishReason.LENGTH)


@pytest.mark.parametrize("kind", ["stub", "sim"])
def test_both_synthetic_kinds_keep_their_text(kind: str) -> None:
    progress = Progress((5,), SamplingParams(max_tokens=2))
    progress.engine_kind = kind
    progress.add(Step((40000,), " t40000"))
    progress.next_leg(ByteTokenizer())
    assert progress.add(Step((40001,), " t40001")) == (" t40001", None)

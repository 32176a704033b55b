"""The text of a migrated request (services/router/execution/migration.py)."""

from __future__ import annotations

import pytest

from services.engines.requests import FinishReason, SamplingParams
from services.router.execution.migration import Progress, Step
from services.tokenization.tokenizer import ByteTokenizer


def test_a_continuation_on_synthetic_engines_keeps_their_text() -> None:
    """Sim and stub token ids run past the byte tokenizer's vocabulary; their text is one word
    per token, so the continuation sends the engine's text as an unbroken run would."""
    progress = Progress((1, 2, 3), SamplingParams(max_tokens=4))
    progress.decode_on("sim")
    assert progress.add(Step((762,), " t762")) == (" t762", None)
    progress.next_leg(ByteTokenizer())  # failed with "token id 762 outside the vocabulary"
    progress.decode_on("sim")
    assert progress.prompt() == (1, 2, 3, 762)
    assert progress.add(Step((763, 764, 765), " t763 t764 t765", FinishReason.LENGTH)) == (
        " t763 t764 t765",
        FinishReason.LENGTH,
    )


def test_a_continuation_on_a_real_engine_is_detokenized_by_the_router() -> None:
    progress = Progress((1,), SamplingParams(max_tokens=4))
    progress.decode_on("reference")
    progress.add(Step((ord("h"),), "h"))
    progress.next_leg(ByteTokenizer())
    progress.decode_on("reference")
    # The engine's text is not used: the router's own detokenization of the whole output is.
    text, finish = progress.add(Step((ord("i"),), "engine text", FinishReason.LENGTH))
    assert (text, finish) == ("i", FinishReason.LENGTH)


@pytest.mark.parametrize("kind", ["stub", "sim"])
def test_both_synthetic_kinds_keep_their_text(kind: str) -> None:
    progress = Progress((5,), SamplingParams(max_tokens=2))
    progress.decode_on(kind)
    progress.add(Step((40000,), " t40000"))
    progress.next_leg(ByteTokenizer())
    assert progress.add(Step((40001,), " t40001")) == (" t40001", None)

"""Token texts of logprob entries as vLLM 0.32 gives them (``decoded_token``): a byte-level
token that leaves a UTF-8 character incomplete is the character it completes, read with the
tokens before it, or empty while the character is still incomplete (checked against vLLM's
server on the tiny checkpoint: tests/e2e/test_openai_params.py and the issue-30 note)."""

from __future__ import annotations

from services.router.frontend.choices import decoded_token
from services.tokenization.tokenizer import ByteTokenizer


def test_a_complete_token_is_its_own_text() -> None:
    tokenizer = ByteTokenizer()
    assert decoded_token(tokenizer, ord("a"), []) == "a"


def test_a_split_character_is_empty_until_its_last_byte_which_carries_it() -> None:
    tokenizer = ByteTokenizer()
    first, second, third = "€".encode()
    assert decoded_token(tokenizer, first, [ord("x")]) == ""
    assert decoded_token(tokenizer, second, [ord("x"), first]) == ""
    assert decoded_token(tokenizer, third, [ord("x"), first, second]) == "€"
    # With no context to complete it, the incomplete byte reads as nothing.
    assert decoded_token(tokenizer, third, []) == ""

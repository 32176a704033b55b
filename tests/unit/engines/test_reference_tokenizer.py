"""Tokenizers: the tiny model's BPE (against transformers' own loading of it) and the byte
fallback."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from services.engines.errors import TokenizerError
from services.engines.reference.tiny_model import CHAT_TEMPLATE
from services.tokenization.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "The prefill reads the prompt; the decode writes one token at a time.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "naïve café, 日本語, emoji 🦙",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_tokenizer_round_trips_and_agrees_with_transformers(tiny_llama, text):
    ours = load_tokenizer(tiny_llama)
    theirs = AutoTokenizer.from_pretrained(tiny_llama)

    ids = ours.encode(text)

    assert ids == theirs(text)["input_ids"]
    assert ids[0] == ours.bos_token_id
    assert ours.decode(ids) == text
    assert ours.encode(text, add_special_tokens=False) == ids[1:]


def test_bpe_tokenizer_exposes_special_ids_and_the_chat_template(tiny_llama):
    tokenizer = load_tokenizer(tiny_llama)

    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.vocab_size == 384
    assert tokenizer.eos_token_ids == {
        tokenizer.token_to_id("<|end_of_text|>"),
        tokenizer.token_to_id("<|eot_id|>"),
    }
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer.encode("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False)
    assert ids[0] == tokenizer.token_to_id("<|start_header_id|>")
    assert ids[-1] == tokenizer.token_to_id("<|end_header_id|>")
    with pytest.raises(TokenizerError):
        tokenizer.decode([384])


def test_chat_template_renders_with_transformers(tiny_llama):
    theirs = AutoTokenizer.from_pretrained(tiny_llama)
    text = theirs.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 256
    assert ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials_and_errors():
    tokenizer = ByteTokenizer(("<s>", "</s>", "<|eot|>"), eos_tokens=("</s>", "<|eot|>"))

    ids = tokenizer.encode("a<|eot|>b</s>", add_special_tokens=False)

    assert ids == [97, 258, 98, 257]
    assert tokenizer.eos_token_ids == {257, 258}
    assert tokenizer.vocab_size == 259
    assert tokenizer.decode(ids) == "ab"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "a<|eot|>b</s>"
    assert tokenizer.decode(list("é".encode())[:1]) == "\ufffd"  # cut mid-character
    with pytest.raises(TokenizerError):
        tokenizer.decode([259])


def test_folder_without_tokenizer_json_falls_back_to_bytes(tmp_path, tiny_llama):
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, tmp_path / name)

    tokenizer = load_tokenizer(tmp_path)

    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
    assert {1, 4} <= tokenizer.eos_token_ids  # config.json's eos ids still stop generation
    assert tokenizer.chat_template == CHAT_TEMPLATE

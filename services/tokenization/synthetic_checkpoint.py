"""The checkpoint of the engines that load no model (stub, sim): what the router's front end
reads for them.

vLLM's front end needs a checkpoint folder (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``) to render prompts and detokenize outputs. The synthetic engines
have none: :func:`write_synthetic_checkpoint` writes one with their vocabulary and context, and
no weights.

Its tokenizer is the byte-level one the synthetic engines' tokens are built on: one token per
UTF-8 byte (ids 0-255), ``<s>`` (BOS, 256) and ``</s>`` (EOS, 257), then one token per
remaining id up to ``vocab_size``, each decoding to ``" t<id>"``, the text the synthetic
engines write for it. Encoding never produces those (the BPE has no merges), so a prompt's ids
are its UTF-8 bytes after BOS. The chat template writes role-prefixed lines and an
``assistant:`` cue.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
BYTE_TOKENS = 256
FIRST_SYNTHETIC_ID = BYTE_TOKENS + 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def write_synthetic_checkpoint(
    directory: str | Path, *, vocab_size: int, max_model_len: int
) -> Path:
    """Write the checkpoint into ``directory`` (created if needed) and return its resolved path.

    The same arguments write the same bytes; an existing folder with those bytes is left as it
    is (several processes may write the same one).
    """
    if vocab_size < FIRST_SYNTHETIC_ID:
        raise ValueError(f"vocab_size must be at least {FIRST_SYNTHETIC_ID} (bytes, <s>, </s>)")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    contents = {
        "config.json": _json(_model_config(vocab_size, max_model_len)),
        "generation_config.json": _json(
            {"bos_token_id": BYTE_TOKENS, "eos_token_id": BYTE_TOKENS + 1}
        ),
        "tokenizer.json": _tokenizer(vocab_size).to_str() + "\n",
        "tokenizer_config.json": _json(
            {
                "bos_token": BOS_TOKEN,
                "eos_token": EOS_TOKEN,
                "chat_template": CHAT_TEMPLATE,
                "clean_up_tokenization_spaces": False,
                "model_max_length": max_model_len,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        ),
    }
    for name in _FILES:
        path = root / name
        if path.is_file() and path.read_text(encoding="utf-8") == contents[name]:
            continue
        partial = path.with_name(f".{name}.partial")
        partial.write_text(contents[name], encoding="utf-8")
        partial.replace(path)  # atomic: a reader sees the old file or the new one
    return root.resolve()


def _tokenizer(vocab_size: int) -> Tokenizer:
    # GPT-2's byte -> printable character table, which ``ByteLevel`` maps bytes through (as
    # vLLM reads it, from transformers; imported here: only writing a checkpoint needs it)
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415

    table: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    vocab = {char: byte for byte, char in table.items()}
    vocab |= {BOS_TOKEN: BYTE_TOKENS, EOS_TOKEN: BYTE_TOKENS + 1}
    space = table[ord(" ")]
    vocab |= {f"{space}t{token_id}": token_id for token_id in range(FIRST_SYNTHETIC_ID, vocab_size)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BYTE_TOKENS)],
    )
    return tokenizer


def _model_config(vocab_size: int, max_model_len: int) -> dict[str, object]:
    """A Llama config: the front end reads its vocabulary, context and EOS, nothing else."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": max_model_len,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "bos_token_id": BYTE_TOKENS,
        "eos_token_id": BYTE_TOKENS + 1,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0",  # a non-Mistral config transformers need not check
    }


def _json(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"

"""Tokenizers for a local checkpoint folder.

``tokenizer.json`` (the HF ``tokenizers`` format, which every fast tokenizer on the Hub ships)
is loaded with the ``tokenizers`` library. A folder without one gets :class:`ByteTokenizer`: one
token per UTF-8 byte plus a few special tokens, enough to serve a model trained on bytes and to
keep the engine usable on checkpoints that have no tokenizer at all (a warning says so).

The chat template (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``)
is exposed as text; rendering it is the router's job.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizerModel

from services.tokenization.errors import TokenizerError, TokenizerFilesError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
GIL_HELD_CHARS = 4096
"""``HFTokenizer`` encodes longer texts with ``tokenizers``' batch API, which releases the GIL
(measured: a 3 MB text took 4.5 s, during which a Python thread ran as often as when idle;
``encode`` starved it for 15 s)."""


class Tokenizer(ABC):
    """Text <-> token ids for one model.

    Called by the router (encode once per request, decode for streaming and final text) and by
    engines (stop on :attr:`eos_token_ids`). Implementations are immutable and thread-safe.
    """

    def __init__(
        self,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
    ) -> None:
        self._bos_token_id = bos_token_id
        self._eos_token_ids = frozenset(eos_token_ids)
        self._chat_template = chat_template

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the model's own framing (a BOS
        token, for Llama) is added. Special-token strings inside ``text`` (as chat templates
        write them) become their special ids."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``. Raises :class:`TokenizerError` for ids outside the
        vocabulary. Invalid UTF-8 (a sequence cut mid-character) decodes to U+FFFD."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (ids are ``0 .. vocab_size - 1``)."""

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the model has one."""
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's EOS plus the model and generation
        configs' ``eos_token_id`` (Llama 3 chat models stop on two)."""
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template text, or ``None`` when the checkpoint has none."""
        return self._chat_template

    def _check_ids(self, token_ids: Sequence[int]) -> None:
        size = self.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < size:
                raise TokenizerError(f"token id {token_id} outside the vocabulary of {size}")


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(
        self,
        model: HFTokenizerModel,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
    ) -> None:
        super().__init__(bos_token_id, eos_token_ids, chat_template)
        self._model = model

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if len(text) <= GIL_HELD_CHARS:
            return list(self._model.encode(text, add_special_tokens=add_special_tokens).ids)
        # ``encode`` holds the GIL for the whole text; the batch API releases it (and skips
        # the character offsets): other threads, the router's event loop, keep running.
        (encoding,) = self._model.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self._check_ids(token_ids)
        return self._model.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._model.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. a special token), or ``None``."""
        return self._model.token_to_id(token)


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte (ids 0-255), then ``special_tokens`` from id 256 in order.

    ``encode`` adds ``bos_token`` (if any) with ``add_special_tokens``; special-token strings in
    the text are matched longest first.
    """

    def __init__(
        self,
        special_tokens: Sequence[str] = ("<s>", "</s>"),
        *,
        bos_token: str | None = "<s>",
        eos_tokens: Sequence[str] = ("</s>",),
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._special_ids = {token: 256 + index for index, token in enumerate(special_tokens)}
        if len(self._special_ids) != len(special_tokens):
            raise ValueError("special tokens must be distinct")
        for token in (*eos_tokens, *([bos_token] if bos_token else [])):
            if token not in self._special_ids:
                raise ValueError(f"{token!r} is not one of the special tokens")
        self._special_tokens = tuple(special_tokens)
        bos_id = self._special_ids[bos_token] if bos_token else None
        eos_ids = {self._special_ids[token] for token in eos_tokens} | set(extra_eos_token_ids)
        super().__init__(bos_id, eos_ids, chat_template)
        by_length = sorted(special_tokens, key=len, reverse=True)
        self._splitter = (
            re.compile("(" + "|".join(re.escape(token) for token in by_length) + ")")
            if by_length
            else None
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        if add_special_tokens and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        parts = self._splitter.split(text) if self._splitter else [text]
        for part in parts:
            special = self._special_ids.get(part)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        self._check_ids(token_ids)
        pieces: list[str] = []
        pending = bytearray()
        for token_id in token_ids:
            if token_id < 256:
                pending.append(token_id)
                continue
            # Bytes decode together so multi-byte characters survive.
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not skip_special_tokens:
                pieces.append(self._special_tokens[token_id - 256])
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._special_tokens)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of the checkpoint in ``directory``: :class:`HFTokenizer` when it has a
    ``tokenizer.json``, otherwise :class:`ByteTokenizer`. Raises :class:`TokenizerFilesError` when
    a file that is present cannot be read."""
    root = Path(directory)
    settings = _read_json(root / TOKENIZER_CONFIG_FILE)
    chat_template = _chat_template(root, settings)
    config_eos = _eos_ids(_read_json(root / MODEL_CONFIG_FILE))
    config_eos |= _eos_ids(_read_json(root / GENERATION_CONFIG_FILE))
    path = root / TOKENIZER_FILE
    if not path.is_file():
        logger.warning("no %s in %s: using the byte-level fallback tokenizer", path.name, root)
        return ByteTokenizer(extra_eos_token_ids=config_eos, chat_template=chat_template)
    try:
        model = HFTokenizerModel.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception for any parse error
        raise TokenizerFilesError(f"cannot load {path}: {exc}") from exc
    bos_token = _token_text(settings.get("bos_token"))
    eos_token = _token_text(settings.get("eos_token"))
    bos_id = model.token_to_id(bos_token) if bos_token else None
    eos_ids = set(config_eos)
    if eos_token is not None:
        eos_id = model.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerFilesError(f"eos_token {eos_token!r} is not in {path}")
        eos_ids.add(eos_id)
    return HFTokenizer(model, bos_id, eos_ids, chat_template)


def _read_json(path: Path) -> Mapping[str, object]:
    """A JSON object file, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFilesError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerFilesError(f"{path} is not a JSON object")
    return value


def _chat_template(root: Path, settings: Mapping[str, object]) -> str | None:
    template_file = root / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        # Several named templates: the one named "default" is the chat template.
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                text = entry.get("template")
                return text if isinstance(text, str) else None
    return None


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _eos_ids(settings: Mapping[str, object]) -> set[int]:
    value = settings.get("eos_token_id")
    items = value if isinstance(value, list) else [value]
    return {item for item in items if isinstance(item, int) and not isinstance(item, bool)}

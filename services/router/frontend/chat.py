"""Rendering chat messages into a prompt with the model's chat template.

The template comes from the checkpoint (``chat_template.jinja`` or ``tokenizer_config.json``);
without one, :data:`DEFAULT_CHAT_TEMPLATE` (role-prefixed lines and an ``assistant:`` cue). It
runs in Jinja's sandbox: templates are data from a checkpoint folder, not trusted code.
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.router.errors import InvalidRequestError
from services.router.frontend.protocol import ChatMessage
from services.tokenization.tokenizer import Tokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatRenderer:
    """Messages -> token ids for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined
        )
        environment.globals["raise_exception"] = _raise_template_error
        source = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
        # Templates written for HF render with trim/lstrip on; ours are single-line anyway.
        self._template = environment.from_string(source)
        self._uses_default = tokenizer.chat_template is None
        self._bos = self._special_text(tokenizer.bos_token_id)
        eos_ids = sorted(tokenizer.eos_token_ids)
        self._eos = self._special_text(eos_ids[0]) if eos_ids else ""

    @property
    def adds_special_tokens(self) -> bool:
        """Whether the rendered text is encoded with the model's special tokens: only with the
        default template (a model's own template writes its framing)."""
        return self._uses_default

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> str:
        """The prompt text; :class:`InvalidRequestError` when the template refuses them."""
        try:
            return self._template.render(
                messages=[
                    {"role": message.role, "content": message.text()} for message in messages
                ],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(
                f"the chat template cannot render these messages: {exc}", param="messages"
            ) from exc

    def tokenize(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool
    ) -> list[int]:
        """Token ids of the rendered prompt. The template writes the model's own framing (BOS),
        so no special tokens are added, except with the default template (which has none)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        return self._tokenizer.encode(text, add_special_tokens=self._uses_default)

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)

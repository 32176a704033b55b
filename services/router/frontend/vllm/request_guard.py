"""Request bodies vLLM 0.32's front end fails on instead of refusing: refused here first.

Fuzzing the front end (``tests/unit/router/frontend/vllm/test_schema_fuzz.py``) found bodies
that vLLM's own server answers with a 500 or with no answer at all, where a malformed request
deserves a 400 naming its field:

- ``structured_outputs`` that is neither an object nor null, on ``/v1/completions`` or
  ``/v1/chat/completions``: vLLM's ``check_structured_outputs_count`` validators call
  ``.get`` on it (``AttributeError``, a 500);
- ``background`` or ``truncation`` null on ``/v1/responses``: the request model takes null,
  the response model refuses it once the engines ran (a 400 after the work, and, streamed,
  after the stream started: no answer at all);
- ``echo`` with an empty prompt in a list (``"prompt": [""]``) on ``/v1/completions``: the
  prompt's text comes back ``None`` and vLLM's echo asserts on it after the engines ran (a
  500; an empty ``"prompt": ""`` it refuses up front, with the message given here).

:func:`refusal` reads a body only when its bytes name one of those fields (a substring test);
every other body goes to vLLM untouched.
"""

from __future__ import annotations

import json

GUARDED_FIELDS: dict[str, tuple[str, ...]] = {
    "/v1/completions": ("structured_outputs", "echo"),
    "/v1/chat/completions": ("structured_outputs",),
    "/v1/responses": ("background", "truncation"),
}
"""The fields checked, by endpoint."""

EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."
"""vLLM's message for an empty prompt."""

_MARKERS = {
    path: tuple(f'"{name}"'.encode() for name in names) for path, names in GUARDED_FIELDS.items()
}


def refusal(path: str, body: bytes) -> tuple[str, str] | None:
    """``(message, param)`` of the 400 for ``body`` posted to ``path``, or ``None``: vLLM
    answers it (a body that is not a JSON object included: vLLM refuses it itself)."""
    markers = _MARKERS.get(path)
    if markers is None or not any(marker in body for marker in markers):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if path == "/v1/responses":
        for name in GUARDED_FIELDS[path]:
            if name in request and request[name] is None:
                return f"{name} must not be null (leave it out for its default)", name
        return None
    value = request.get("structured_outputs")
    if value is not None and not isinstance(value, dict):
        kind = type(value).__name__
        return f"structured_outputs must be an object, not {kind}", "structured_outputs"
    prompt = request.get("prompt")
    if request.get("echo") is True and isinstance(prompt, list) and "" in prompt:
        return EMPTY_PROMPT, "prompt"
    return None

"""How each :class:`~services.engines.requests.SamplingParams` field crosses pdserve's seams: the
one table the proto conversions (:mod:`services.serving.wire.fields`) and the vLLM mappings both
ways (:func:`vllm_kwargs`, :func:`from_vllm`) walk, so a field is spelled in the proto and the
dataclass only.

The proto's descriptor (``types_pb2.SamplingParams.DESCRIPTOR.fields``) gives each field's wire
form (repeated, map, explicit presence, float32). vLLM's ``SamplingParams`` spells most fields as
pdserve does, with the same value; :data:`RULES` lists only the fields that differ, and a field
it does not name crosses every seam unchanged. ``tests/unit/serving/test_convert.py`` holds the
dataclass, the descriptor and :data:`RULES` to the same names (and round-trips every field),
``tests/unit/vllm/test_backend_mapping.py`` the names to vLLM's ``SamplingParams`` (and every
field through vLLM and back). Imports nothing of vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from services.engines.errors import InvalidRequest
from services.engines.requests import SamplingParams

SEED_MASK = 2**63 - 1
"""pdserve's engines take a 64-bit unsigned seed; vLLM's is any Python int."""


def _same(value: Any) -> Any:
    return value


def clamp_bias(pairs: Any) -> tuple[tuple[int, float], ...]:
    """``(token id, bias)`` pairs sorted by token, each bias clamped to [-100, 100] (vLLM's
    bound), from a mapping or pairs."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple(sorted((int(token), max(-100.0, min(100.0, bias))) for token, bias in items))


def structured_outputs_kwargs(text: str) -> dict[str, Any] | None:
    """``StructuredOutputsParams`` keyword arguments of the proto's JSON object (``None`` when
    unconstrained); :class:`InvalidRequest` when it is not a JSON object."""
    if not text:
        return None
    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"structured_outputs is not JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise InvalidRequest("structured_outputs must be a JSON object")
    return fields


def structured_outputs_json(constraint: Any) -> str:
    """vLLM's ``StructuredOutputsParams`` as the proto carries it: a JSON object of its public
    fields that differ from their defaults ("" when unconstrained)."""
    if constraint is None:
        return ""
    fields = {
        field.name: getattr(constraint, field.name)
        for field in dataclasses.fields(constraint)
        if not field.name.startswith("_") and getattr(constraint, field.name) != field.default
    }
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one field differs from the plain case (same name and value everywhere)."""

    in_vllm: bool = True
    """vLLM's ``SamplingParams`` has the field, under the same name. ``False``: pdserve's own
    (``n`` is fanned out per choice by the router, ``output_tokens_in_prompt`` goes to vLLM's
    workers in ``extra_args``, see :mod:`services.engines.vllm.request_mapping`)."""
    to_vllm: Callable[[Any], Any] = _same
    """pdserve's value -> vLLM's keyword argument."""
    from_vllm: Callable[[Any], Any] = _same
    """vLLM's value -> pdserve's (the router's front end, one choice)."""
    detokenization: bool = False
    """Applied where text is made: the router's detokenizer applies vLLM's value, and the
    engines get the default (their detokenizers only find stop strings)."""
    zero_reads_as_default: bool = False
    """The proto's zero (unset) reads as the dataclass default, not as zero."""
    normalize: Callable[[Any], Any] = _same
    """Applied to the value read from the proto (after its float32 rounding)."""
    extended: bool = False
    """Added with vLLM's parameters (types.proto fields 9-19, 22): an engine kind that predates
    them may ignore it (:mod:`services.router.frontend.engine_support`)."""


_EXTENDED = Rule(extended=True)

RULES: dict[str, Rule] = {
    "top_p": Rule(zero_reads_as_default=True),
    # vLLM: -1 (or 0) considers every token; pdserve's proto: 0
    "top_k": Rule(to_vllm=lambda k: k if k > 0 else -1, from_vllm=lambda k: max(k, 0)),
    "seed": Rule(from_vllm=lambda seed: None if seed is None else seed & SEED_MASK),
    "stop": Rule(to_vllm=list, from_vllm=lambda v: tuple(v or ())),
    "stop_token_ids": Rule(to_vllm=list, from_vllm=lambda v: tuple(v or ())),
    "presence_penalty": _EXTENDED,
    "frequency_penalty": _EXTENDED,
    "repetition_penalty": _EXTENDED,
    "min_p": _EXTENDED,
    "min_tokens": _EXTENDED,
    "logit_bias": Rule(
        to_vllm=lambda pairs: dict(pairs) or None,
        from_vllm=lambda bias: clamp_bias(bias or {}),
        normalize=clamp_bias,
        extended=True,
    ),
    "logprobs": _EXTENDED,
    "prompt_logprobs": _EXTENDED,
    "include_stop_str_in_output": _EXTENDED,
    "skip_special_tokens": Rule(detokenization=True, extended=True),
    "spaces_between_special_tokens": Rule(detokenization=True, extended=True),
    "n": Rule(in_vllm=False, zero_reads_as_default=True),
    "output_tokens_in_prompt": Rule(in_vllm=False),
    # vLLM: a StructuredOutputsParams (the engine builds it from these keyword arguments)
    "structured_outputs": Rule(
        to_vllm=structured_outputs_kwargs, from_vllm=structured_outputs_json, extended=True
    ),
}
"""The fields that differ from the plain case, by name (the rest: :data:`PLAIN`)."""

PLAIN = Rule()

NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(SamplingParams))
"""Every field, in the dataclass's (and the proto's) order."""

DEFAULTS: dict[str, Any] = {
    field.name: field.default for field in dataclasses.fields(SamplingParams)
}
"""Each field's default (what an unset proto field reads as)."""


def rule(name: str) -> Rule:
    """The rule of field ``name``."""
    return RULES.get(name, PLAIN)


EXTENDED_PARAMS: tuple[str, ...] = tuple(name for name in NAMES if rule(name).extended)
"""The fields an engine kind that predates vLLM's parameters may ignore."""


_TO_VLLM = tuple((name, rule(name).to_vllm) for name in NAMES if rule(name).in_vllm)
_FROM_VLLM = tuple(
    (name, rule(name).from_vllm)
    for name in NAMES
    if rule(name).in_vllm and not rule(name).detokenization
)


def vllm_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments of every field vLLM has (``structured_outputs``
    as ``StructuredOutputsParams``' own keyword arguments, or ``None``)."""
    return {name: convert(getattr(sampling, name)) for name, convert in _TO_VLLM}


def from_vllm(params: Any) -> SamplingParams:
    """pdserve's sampling parameters for vLLM's ``SamplingParams`` of one choice: every field
    vLLM has but the detokenization options (the router's detokenizer applies those)."""
    return SamplingParams(**{name: convert(getattr(params, name)) for name, convert in _FROM_VLLM})

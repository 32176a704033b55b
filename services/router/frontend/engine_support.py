"""What each engine kind can honour: a request whose sampling parameters one of the engines
that may serve it cannot honour is a 400 naming the parameter and the engine, never sent and
silently ignored (:func:`check_engines`, called by the front end's engine client once vLLM's
``SamplingParams`` are converted into the engines' spelling).

:data:`ENGINE_UNSUPPORTED` is the table; a kind missing from it gets only the parameters every
pdserve engine had before the sampling fields were added (it may predate them and would ignore
them).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from services.control_plane.wire import EngineRecord
from services.engines.requests import SamplingParams
from services.engines.sampling_fields import EXTENDED_PARAMS
from services.router.errors import InvalidRequestError

_NEUTRAL = SamplingParams()

ENGINE_UNSUPPORTED: dict[str, frozenset[str]] = {
    "vllm": frozenset(),
    # The reference engine's detokenizer always skips special tokens; it samples
    # unconstrained (no grammar library).
    "reference": frozenset(
        {"skip_special_tokens", "spaces_between_special_tokens", "structured_outputs"}
    ),
    # The stub engine of the router tests samples nothing; nor does the simulated engine.
    "stub": frozenset(EXTENDED_PARAMS),
    "sim": frozenset(EXTENDED_PARAMS),
}


_extended_values = operator.attrgetter(*EXTENDED_PARAMS)
_NEUTRAL_VALUES = _extended_values(_NEUTRAL)


def non_default(sampling: SamplingParams) -> list[str]:
    """The extended fields ``sampling`` sets to something other than their default."""
    values = _extended_values(sampling)
    if values == _NEUTRAL_VALUES:  # most requests: one C-level read and compare
        return []
    return [
        name
        for name, value, neutral in zip(EXTENDED_PARAMS, values, _NEUTRAL_VALUES, strict=True)
        if value != neutral
    ]


def check_engines(records: Iterable[EngineRecord], sampling: SamplingParams) -> None:
    """400 when an engine that may serve the request cannot honour one of its parameters."""
    wanted = non_default(sampling)
    if not wanted:
        return
    for record in records:
        unsupported = ENGINE_UNSUPPORTED.get(record.engine_kind, frozenset(EXTENDED_PARAMS))
        for name in wanted:
            if name in unsupported:
                raise InvalidRequestError(
                    f"{name}={getattr(sampling, name)!r} is not supported by engine "
                    f"{record.engine_id} ({record.engine_kind} engine)",
                    param=name,
                    code="unsupported_parameter",
                )

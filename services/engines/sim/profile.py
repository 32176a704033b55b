"""A GPU engine's timing as a profile: what the simulated engine sleeps for, and its format.

A profile is a JSON file (shipped ones in ``profiles/``, named by file stem; ``--sim-profile``
takes a name or a path)::

    {
      "format_version": 1,
      "name": "llama-3.1-8b-h100",            # the stem; the engine serves "sim-<name>"
      "description": "...",
      "source": {"url": "...", "figures": "...", "derivation": "..."},   # where it came from
      "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "num_layers": 32,
                "num_kv_heads": 8, "head_size": 128, "vocab_size": 128256,
                "max_model_len": 8192, "dtype": "bfloat16"},
      "prefill": {"base_ms": a, "per_token_ms": b, "per_token_squared_ms": c},
      "decode": {"base_ms": d, "per_sequence_ms": e, "per_context_token_ms": f},
      "kv_cache": {"num_blocks": 28000, "block_size": 16},
      "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 256},
      "kv_transfer": {"base_ms": g, "gb_per_s": h},    # optional: no transfer time without
      "layout": {"engine_kind": "vllm", "mode": "disaggregated",      # what was measured
                 "prefill": {"pp_size": 1, "tp_size": 1},             # (null when colocated)
                 "decode": {"pp_size": 1, "tp_size": 1}},             # (the colocated engine)
      "measured": {"ttft": [{"input_tokens": 64, "ms": 41.2}, ...],   # optional: the points
                   "itl": [{"batch": 4, "context_tokens": 128, "ms": 9.1}, ...]}
    }

The model (all times in milliseconds, one engine step = one forward pass):

- a prefill of ``T`` prompt tokens alone: ``a + b*T + c*T**2`` (``c`` is attention's quadratic
  part; a chunk of ``n`` tokens after ``p`` already computed costs ``b*n + c*((p+n)**2 - p**2)``,
  so the chunks of a prompt add up to the whole prompt's variable cost);
- a decode step of ``B`` sequences holding ``C`` context tokens in all: ``d + e*B + f*C``
  (``f*C`` = ``f*B*mean_context``: reading the KV);
- a mixed step (chunked prefill in a colocated engine: prefill chunks and decode tokens share
  one step's token budget) pays one fixed cost, ``max(a, d)``, and every variable term, so a
  decode step that carries a prefill chunk is longer by that chunk's cost: the interference
  disaggregation removes.

``kv_cache`` is the engine's KV capacity in blocks of ``block_size`` tokens; ``scheduler`` the
vLLM limits it admits by (``max_num_batched_tokens`` per step, ``max_num_seqs`` running).
``kv_transfer`` (optional) is the prefill -> decode hand-off of a disaggregated request: a
prompt of ``T`` tokens moves ``T * kv_bytes_per_token`` bytes (``2 * num_layers * num_kv_heads *
head_size * dtype bytes``) in ``g + bytes / (h * 1e9) * 1000`` ms before its decode begins.
``layout`` is what the figures are of: the engine kind and PP x TP of each side (format 2; a
format-1 file has none). A simulated engine started with another PP x TP, or a planner whose
router serves another model or is told other pools' layouts, refuses the profile at start
(:func:`check_layout`, :func:`check_model`). ``measured`` (optional) keeps the points
``pdserve profile`` measured and fitted the coefficients to.
Unknown keys and negative figures are refused (:class:`SimProfileError`), naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.control_plane.aggregation import DTYPE_BYTES
from services.engines.errors import EngineError
from services.topology import ModelShape

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
"""The shipped profiles, one ``<name>.json`` each."""

DEFAULT_PROFILE = "llama-3.1-8b-h100"

PROFILE_FORMAT_VERSION = 2
"""1: the first format (linear + quadratic prefill, linear decode, KV blocks, vLLM limits).
2: ``layout`` (engine kind, mode, PP x TP per side; required) and ``measured`` (optional)."""
READABLE_FORMAT_VERSIONS = (1, 2)
"""Versions still read: a format-1 profile has no layout (and none is checked)."""


class SimProfileError(EngineError, ValueError):
    """A profile that cannot be found, read or trusted (the message names the file and field)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProfileSource(_Frozen):
    url: str = Field(min_length=1)
    """Where the figures were published."""
    figures: str = Field(min_length=1)
    """The published figures the coefficients come from."""
    derivation: str = ""
    """How the coefficients were fitted or derived from them."""


class ProfileModel(_Frozen):
    """The model and KV geometry the profiled engine served."""

    name: str = Field(min_length=1)
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_size: int = Field(ge=1)
    vocab_size: int = Field(ge=2)
    max_model_len: int = Field(ge=2)
    dtype: Literal["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"] = "bfloat16"
    """The KV cache's dtype."""

    @property
    def shape(self) -> ModelShape:
        """The model's shape (uncut: one engine of PP=1 x TP=1; no block size)."""
        return ModelShape.of(self)


class PrefillTiming(_Frozen):
    base_ms: float = Field(ge=0)
    per_token_ms: float = Field(ge=0)
    per_token_squared_ms: float = Field(ge=0)


class DecodeTiming(_Frozen):
    base_ms: float = Field(ge=0)
    per_sequence_ms: float = Field(ge=0)
    per_context_token_ms: float = Field(ge=0)


class KVCache(_Frozen):
    num_blocks: int = Field(ge=1)
    block_size: int = Field(ge=1)


class SchedulerLimits(_Frozen):
    max_num_batched_tokens: int = Field(ge=1)
    """Tokens one step computes at most (prefill chunks and decode tokens together)."""
    max_num_seqs: int = Field(ge=1)
    """Sequences running at once at most."""


class KVTransferTiming(_Frozen):
    base_ms: float = Field(ge=0)
    """Per transfer, whatever its size (notification, descriptor set-up)."""
    gb_per_s: float = Field(gt=0)
    """The link's bandwidth in GB/s (1e9 bytes)."""


class SideLayout(_Frozen):
    """One engine's parallel layout."""

    pp_size: int = Field(default=1, ge=1)
    tp_size: int = Field(default=1, ge=1)

    def __str__(self) -> str:
        return f"PP={self.pp_size} x TP={self.tp_size}"


class ProfileLayout(_Frozen):
    """What was measured: the engine kind and each side's layout."""

    engine_kind: str = Field(min_length=1)
    """``vllm``, ``reference``... (``nim`` for the shipped, published figures)."""
    mode: Literal["disaggregated", "colocated"]
    prefill: SideLayout | None = None
    """The prefill engines' layout (disaggregated only)."""
    decode: SideLayout
    """The decode engines' (colocated: the one engine's)."""

    @model_validator(mode="after")
    def _sides(self) -> ProfileLayout:
        if (self.mode == "disaggregated") != (self.prefill is not None):
            raise ValueError("a disaggregated layout has a prefill side, a colocated one none")
        return self

    def sides(self) -> dict[str, SideLayout]:
        """Each side's layout by role (``prefill`` and ``decode``; colocated: the engine's for
        both)."""
        return {"prefill": self.prefill or self.decode, "decode": self.decode}

    def __str__(self) -> str:
        if self.prefill is None:
            return f"{self.engine_kind} colocated {self.decode}"
        return f"{self.engine_kind} prefill {self.prefill}, decode {self.decode}"


class TtftPoint(_Frozen):
    input_tokens: int = Field(ge=1)
    ms: float = Field(ge=0)


class ItlPoint(_Frozen):
    batch: int = Field(ge=1)
    """Concurrent streams started together."""
    context_tokens: int = Field(ge=0)
    """Context tokens of each stream at the middle of the measured window."""
    ms: float = Field(ge=0)
    effective_batch: float | None = Field(default=None, ge=0)
    """Streams decoding over the measured window, time-weighted (``batch`` when every stream
    decoded through it; absent in files measured before it was recorded: ``batch``)."""
    output_tokens: int | None = Field(default=None, ge=1)
    """Tokens each stream generated."""
    window_gaps: int | None = Field(default=None, ge=0)
    """The fewest gaps between tokens any stream had in the measured window."""

    @property
    def decoding(self) -> float:
        """The batch the point was measured at: ``effective_batch``, else ``batch``."""
        return self.batch if self.effective_batch is None else self.effective_batch


class Measured(_Frozen):
    """The points a profile's coefficients were fitted to (``pdserve profile``)."""

    ttft: tuple[TtftPoint, ...] = ()
    """Time to first token of one request alone, by prompt length."""
    itl: tuple[ItlPoint, ...] = ()
    """Mean gap between tokens of ``batch`` concurrent streams."""


class SimProfile(_Frozen):
    """One profile (see the module docstring for the format and the timing model)."""

    format_version: int
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    description: str = ""
    source: ProfileSource
    model: ProfileModel
    prefill: PrefillTiming
    decode: DecodeTiming
    kv_cache: KVCache
    scheduler: SchedulerLimits
    kv_transfer: KVTransferTiming | None = None
    layout: ProfileLayout | None = None
    """Required from format 2 (``None``: a format-1 profile, of an unrecorded layout)."""
    measured: Measured | None = None

    @model_validator(mode="after")
    def _layout_from_format_2(self) -> SimProfile:
        if self.format_version >= 2 and self.layout is None:
            raise ValueError("format 2 needs the layout the figures are of")
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over every layer and KV head (keys and values)."""
        model = self.model
        return (
            2 * model.num_layers * model.num_kv_heads * model.head_size * DTYPE_BYTES[model.dtype]
        )

    def transfer_ms(self, num_tokens: int) -> float:
        """Moving ``num_tokens`` tokens' KV from a prefill to a decode engine (0 without
        ``kv_transfer``)."""
        if self.kv_transfer is None or num_tokens <= 0:
            return 0.0
        seconds = num_tokens * self.kv_bytes_per_token / (self.kv_transfer.gb_per_s * 1e9)
        return self.kv_transfer.base_ms + seconds * 1000

    @property
    def served_model(self) -> str:
        """The model name a simulated engine of this profile registers (and the router
        serves): never the real model's, so nobody mistakes a simulation for it."""
        return f"sim-{self.name}"

    def prefill_ms(self, num_tokens: int) -> float:
        """A prefill of ``num_tokens`` prompt tokens alone in one step."""
        if num_tokens <= 0:
            return 0.0
        return self.step_ms(prefill_chunks=((0, num_tokens),))

    def decode_step_ms(self, batch: float, context_tokens: float) -> float:
        """A decode step of ``batch`` sequences holding ``context_tokens`` in all (a fractional
        batch: a measured mean)."""
        if batch <= 0:
            return 0.0
        return self.step_ms(decode_batch=batch, decode_context_tokens=context_tokens)

    def step_ms(
        self,
        *,
        prefill_chunks: Iterable[tuple[int, int]] = (),
        decode_batch: float = 0,
        decode_context_tokens: float = 0,
    ) -> float:
        """One step: prefill chunks ``(tokens computed before, tokens now)`` and
        ``decode_batch`` decode tokens over ``decode_context_tokens`` of context; 0 when
        empty."""
        prefill, decode = self.prefill, self.decode
        chunks = [(before, now) for before, now in prefill_chunks if now > 0]
        if not chunks and decode_batch <= 0:
            return 0.0
        fixed = max(prefill.base_ms if chunks else 0.0, decode.base_ms if decode_batch else 0.0)
        prefill_tokens = sum(now for _, now in chunks)
        pairs = sum((before + now) ** 2 - before**2 for before, now in chunks)
        return (
            fixed
            + prefill.per_token_ms * prefill_tokens
            + prefill.per_token_squared_ms * pairs
            + decode.per_sequence_ms * max(decode_batch, 0)
            + decode.per_context_token_ms * max(decode_context_tokens, 0)
        )


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in :data:`PROFILES_DIR`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def resolve_profile_path(name_or_path: str) -> Path:
    """A shipped profile's file by name, or the file at a path (anything with a ``/`` or a
    ``.json`` suffix); :class:`SimProfileError` naming the choices when there is none."""
    if "/" in name_or_path or name_or_path.endswith(".json"):
        path = Path(name_or_path)
        if not path.is_file():
            raise SimProfileError(f"sim profile {name_or_path}: no such file")
        return path
    path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise SimProfileError(
            f"unknown sim profile {name_or_path!r}: choose one of "
            f"{', '.join(shipped_profiles())} or give a path to a JSON profile"
        )
    return path


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> SimProfile:
    """The profile named or at ``name_or_path`` (see :func:`resolve_profile_path`),
    validated."""
    path = resolve_profile_path(name_or_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SimProfileError(f"sim profile {path}: cannot be read: {exc}") from exc
    return parse_profile(data, origin=str(path))


def parse_profile(data: object, *, origin: str = "<profile>") -> SimProfile:
    """A profile from parsed JSON; :class:`SimProfileError` naming the first bad field."""
    if isinstance(data, dict) and data.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise SimProfileError(
            f"sim profile {origin}: format_version {data.get('format_version')!r} is not one "
            f"of {', '.join(map(str, READABLE_FORMAT_VERSIONS))}"
        )
    try:
        return SimProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise SimProfileError(f"sim profile {origin}: {where}: {first['msg']}") from exc


def check_layout(profile: SimProfile, given: SideLayout, role: str | None = None) -> None:
    """:class:`SimProfileError` naming both when ``profile`` was measured with another layout
    than ``given`` on the ``role`` side (``prefill`` or ``decode``; ``None``: on either, for an
    engine that does not know its role); a format-1 profile (no layout recorded) passes."""
    if profile.layout is None:
        return
    sides = profile.layout.sides()
    measured = [sides[role]] if role is not None else list(sides.values())
    if given not in measured:
        engines = f"the {role} engines" if role is not None else "this engine"
        raise SimProfileError(
            f"profile {profile.name} was measured on {profile.layout} (model "
            f"{profile.model.name}); {engines} here: {given}. Measure this layout with "
            "pdserve profile, or give the layout the profile was made for"
        )


def check_model(profile: SimProfile, served: Iterable[str]) -> None:
    """:class:`SimProfileError` naming both when none of the ``served`` models is
    ``profile``'s (its model's name, or ``sim-<name>`` of its simulated engines)."""
    served = sorted(served)
    if profile.model.name in served or profile.served_model in served:
        return
    raise SimProfileError(
        f"profile {profile.name} is of model {profile.model.name} (simulated: "
        f"{profile.served_model}); the router serves {', '.join(served) or 'no model'}"
    )

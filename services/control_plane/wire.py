"""Wire format of every value pdserve keeps in Redis: versioned, size-bounded msgpack.

Redis is a trust boundary: anything read back may be truncated, oversized, of another protocol
version, or written by someone hostile. :func:`decode` therefore bounds sizes before and while
unpacking, checks the envelope (protocol version and record kind), and builds the frozen
dataclass field by field with strict type checks. It raises :class:`RecordDecodeError` with a
``reason`` (``oversized``, ``malformed``, ``wrong_version``, ``wrong_kind``, ``schema``) and never
anything else. Nothing is ever pickled.

Envelope: ``{"v": PROTOCOL_VERSION, "k": <record kind>, "d": {<field>: <value>}}``. Ranges travel
as ``[start, stop]``, enums as their string value, an engine record's :class:`ModelShape` flat
(its :data:`RECORD_SHAPE_FIELDS` beside the record's other fields, as written before the record
embedded it).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgpack

from services.codec import MsgpackBounds, UnpackError, unpack_bounded
from services.control_plane.errors import RecordDecodeError
from services.topology import ModelShape, Range

# Protocol history:
#   1: first version (engine record, handshake record, status, load, event); the engine
#      record's max_model_len was added later with a default (0 = unknown), so records
#      written before it still decode; so were the load's prefix_cache_reported and
#      cached_block_hashes (a router that predates them refuses such a load record as
#      malformed: upgrade routers before engines); so was the load's kv_events_seq (-1 when
#      absent: unknown); so were the record's max_loras (0: no LoRA) and the load's
#      lora_adapters (empty). The engine record's shape fields became one embedded
#      ModelShape in memory; the bytes stayed the same.
PROTOCOL_VERSION = 1

MAX_RECORD_BYTES = 4 * 1024 * 1024
MAX_REPORTED_BLOCKS = 1024
"""Most prefix-cache block hashes a load record carries (about 9 KiB of msgpack)."""
"""Upper bound of one encoded value (NIXL agent metadata dominates; a few KiB to ~1 MiB)."""
MAX_REPORTED_ADAPTERS = 256
"""Most LoRA adapter names a load record carries."""
MAX_REGIONS = 8192
"""Upper bound of registered KV regions per worker (2 per layer: K and V)."""
MAX_ID_LENGTH = 128

EngineId = str
Generation = int

_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_identifier(value: str, what: str = "engine id") -> str:
    """Return ``value`` if it is a safe identifier (it becomes part of Redis keys), else raise."""
    if not _ID_PATTERN.match(value):
        raise ValueError(
            f"invalid {what} {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


class EngineRole(enum.StrEnum):
    """What an engine serves: prefill (KV producer), decode (KV consumer) or both."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    @property
    def produces_kv(self) -> bool:
        """Whether it prefills and holds KV for other engines (``prefill`` or ``both``)."""
        return self is not EngineRole.DECODE

    @property
    def consumes_kv(self) -> bool:
        """Whether it decodes from KV pulled from other engines (``decode`` or ``both``)."""
        return self is not EngineRole.PREFILL


class EngineState(enum.StrEnum):
    """Readiness of an engine's current generation."""

    PENDING = "pending"
    """Registered; its handshake grid is not complete yet."""
    READY = "ready"
    """Every (pp, tp) record present and consistent: peers may connect and pull."""
    INVALID = "invalid"
    """The grid is complete but inconsistent (hash mismatch, layer gap...): see problems."""


class EventKind(enum.StrEnum):
    """Change events sent on the control plane's pub/sub channel."""

    REGISTERED = "registered"
    HANDSHAKE = "handshake"
    STATE = "state"
    DEREGISTERED = "deregistered"


@dataclass(frozen=True)
class EngineRecord:
    """One registration of an engine: what it is, its layout and where it is served.

    ``generation`` is assigned by the control plane and changes on every registration.
    """

    engine_id: EngineId
    generation: Generation
    role: EngineRole
    model: str
    compat_hash: str
    shape: ModelShape
    """The model's shape as the engine runs it: only :data:`RECORD_SHAPE_FIELDS` (the others
    unknown). Its ``max_model_len`` (the context, prompt + output tokens) may be 0 = unknown:
    the router then cannot check a request's length against it."""
    endpoint: str
    pp_aware: bool
    lease_ttl_ms: int
    registered_at_ms: int
    engine_kind: str = "reference"
    """The engine backend (``reference`` or ``vllm``), for operators."""
    kv_events_endpoint: str = ""
    """Where the engine publishes its KV-cache events (a ZMQ PUB address, ``tcp://host:port``;
    ``services.kv_events``); empty = it publishes none. Part of this generation's record, so a
    restarted engine's endpoints come with its new generation."""
    kv_events_replay_endpoint: str = ""
    """The engine's KV-event replay endpoint (ZMQ ROUTER: send a start sequence number, get the
    buffered batches from it on); empty = no replay."""
    kv_block_bytes: int = 0
    """The bytes of one KV block of the whole engine (every layer's K and V, every KV head):
    what a KV transfer moves per block; 0 = unknown."""
    max_loras: int = 0
    """LoRA adapters the engine runs at once in a batch (vLLM's ``max_loras``); 0 = it serves
    no adapter (the reference engine, vLLM without ``--enable-lora``). Which adapters it holds
    is on its load record (:attr:`EngineLoad.lora_adapters`)."""

    def __post_init__(self) -> None:
        if self.shape != record_shape(self.shape):
            raise ValueError(
                f"an engine record's shape carries only {', '.join(RECORD_SHAPE_FIELDS)}: "
                f"{self.shape} (use record_shape())"
            )


RECORD_SHAPE_FIELDS = (
    "pp_size",
    "tp_size",
    "num_layers",
    "num_kv_heads",
    "block_size",
    "max_model_len",
)
"""The fields of an engine's :class:`ModelShape` its record carries, flat on the wire under these
names (as before the record embedded the shape). The others stay unknown in a record: the compat
hash covers head size and dtype, the handshake records the PP partition, and the vocabulary is
the engine's own. Carrying another would make routers that predate it refuse the record."""

_SHAPE_FIELDS_ADDED = frozenset({"max_model_len"})
"""Shape fields added to protocol 1 after its first records: absent on the wire = unknown."""


def record_shape(shape: ModelShape) -> ModelShape:
    """``shape`` as an engine record carries it: :data:`RECORD_SHAPE_FIELDS`, the rest unknown."""
    return ModelShape(**{name: getattr(shape, name) for name in RECORD_SHAPE_FIELDS})


KV_LAYOUT_HND = "HND"
"""K and V in separate regions, two per layer ``(layer0 K, layer0 V, layer1 K, ...)``; a block
is ``[kv_heads, block_size, head_size]`` (pdserve's reference engine)."""
KV_LAYOUT_HNC = "HNC"
"""K and V in one region per layer; a block is ``[kv_heads, block_size, C]`` where ``C`` holds a
head's K and V (vLLM 0.32's ``LBHNC``: on CPUs each head's K rows then its V rows)."""
KV_REGIONS_PER_LAYER = {KV_LAYOUT_HND: 2, KV_LAYOUT_HNC: 1}
"""The layouts a record may name (any other is refused by aggregation): regions per layer.
Both keep a head's part of a block contiguous, which is what a head-sliced read needs."""


def kv_block_len(
    kv_layout: str, *, heads: int, block_size: int, head_size: int, element: int
) -> int:
    """The bytes of one block of one region in ``kv_layout`` (raises ``KeyError`` for others)."""
    per_region = 2 // KV_REGIONS_PER_LAYER[kv_layout]
    return per_region * heads * block_size * head_size * element


@dataclass(frozen=True)
class HandshakeRecord:
    """The KV-transfer metadata of one ``(pp_rank, tp_rank)`` worker of one engine generation.

    The worker's KV lives in ``KV_REGIONS_PER_LAYER[kv_layout] * len(layers)`` registered
    regions, in layer order (``HND``: K then V of each layer; ``HNC``: one per layer), with
    ``region_base_addrs`` giving each base. Every region holds ``num_blocks`` blocks of
    ``block_len`` bytes, ``block_stride`` bytes apart (:func:`kv_block_len`). A block is
    head-major, so a head slice of one block of one region is one contiguous range: head ``h``
    (local) starts at ``h * block_len // len(kv_heads)``.
    """

    engine_id: EngineId
    generation: Generation
    pp_rank: int
    tp_rank: int
    worker_id: str
    """Unique per worker process incarnation: tells a re-publish from a duplicate rank."""
    agent_name: str
    agent_metadata: bytes
    """The NIXL agent's metadata blob (``get_agent_metadata()``), passed to ``add_remote_agent``."""
    memory_type: str
    """NIXL memory type of the regions: ``DRAM`` or ``VRAM``."""
    device_id: int
    region_base_addrs: tuple[int, ...]
    num_blocks: int
    block_len: int
    block_stride: int
    block_size: int
    dtype: str
    head_size: int
    kv_layout: str
    layers: Range
    kv_heads: Range
    compat_hash: str
    extra: bytes = b""
    """Engine-specific opaque data (the vLLM backend keeps its own handshake payload here)."""


@dataclass(frozen=True)
class EngineStatus:
    """Readiness of one engine generation, written atomically by the aggregator."""

    engine_id: EngineId
    generation: Generation
    state: EngineState
    problems: tuple[str, ...]
    handshake_version: int
    """The handshake hash version this status was computed from (compare-and-set guard)."""
    updated_at_ms: int
    ready_latency_ms: int = -1
    """Registration to READY, when READY."""


@dataclass(frozen=True)
class EngineLoad:
    """Load figures an engine refreshes on each heartbeat (the router's scheduling input)."""

    queue_depth: int = 0
    running_requests: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    prefix_cache_reported: bool = False
    """Whether :attr:`cached_block_hashes` is the engine's prefix cache (an engine without a
    prefix cache, or one that cannot list it, leaves both at their defaults)."""
    cached_block_hashes: tuple[int, ...] = ()
    """The chained hashes of the full blocks the engine's prefix cache holds, most recently
    used first, at most :data:`MAX_REPORTED_BLOCKS` (hash ``i`` covers tokens
    ``[0, (i + 1) * block_size)``, ``services.router.scheduling.policies.prompt_block_hashes``)."""
    kv_events_seq: int = -1
    """The sequence number of the last KV-event batch the engine handed to its publisher (sent,
    or dropped by a full queue), -1 when none yet or unknown (no events, or a publisher the
    host cannot see: vLLM's lives in its engine core). A router whose subscription stays behind
    it marks the engine stale (``silent``: docs/kv-events.md, "Precise placement from KV
    events")."""
    lora_adapters: tuple[str, ...] = ()
    """The names of the LoRA adapters the engine holds loaded (at most
    :data:`MAX_REPORTED_ADAPTERS`, sorted): the router prefers these engines for a request
    naming one (docs/router.md, "LoRA adapters")."""


@dataclass(frozen=True)
class Event:
    """A change notification on pub/sub: readers re-read the engine (pub/sub is lossy)."""

    engine_id: EngineId
    generation: Generation
    kind: EventKind
    state: str = ""


_KINDS: dict[type[Any], str] = {
    EngineRecord: "engine",
    HandshakeRecord: "handshake",
    EngineStatus: "status",
    EngineLoad: "load",
    Event: "event",
}

T = TypeVar("T")


_HASHED_SHAPE_FIELDS = ("dtype", "head_size", "num_layers", "num_kv_heads")
"""The :class:`ModelShape` fields the compat hash covers, in the order it hashes them."""


def compute_compat_hash(
    shape: ModelShape, *, model: str, kv_layout: str, engine_kind: str = "reference"
) -> str:
    """The compatibility hash: equal on two engines iff their KV can be moved between them.

    Covers exactly the fields that must match across a transfer: model, the shape's KV dtype,
    head size, layer and KV-head counts, layout, protocol version, engine kind. The shape's other
    fields are not covered (block size is checked separately so a mismatch gets its own message;
    the PP x TP cut may differ). Raises ``ValueError`` when a covered field of ``shape`` is
    unknown (an engine record's shape, for one, carries neither dtype nor head size).
    """
    unknown = [name for name in _HASHED_SHAPE_FIELDS if not getattr(shape, name)]
    if unknown:
        raise ValueError(f"compat hash of a shape whose {', '.join(unknown)} is unknown: {shape}")
    fields = (
        f"pdserve-kv/{PROTOCOL_VERSION}",
        engine_kind,
        model,
        *(str(getattr(shape, name)) for name in _HASHED_SHAPE_FIELDS),
        kv_layout,
    )
    return hashlib.sha256("\x1f".join(fields).encode()).hexdigest()[:32]


def _to_wire(value: Any) -> Any:
    if isinstance(value, Range):
        return [value.start, value.stop]
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_wire(item) for item in value]
    return value


def encode(record: Any) -> bytes:
    """Encode a record dataclass into its versioned envelope (a :class:`ModelShape` flat: its
    :data:`RECORD_SHAPE_FIELDS` in place of the field that holds it)."""
    kind = _KINDS[type(record)]
    payload: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if isinstance(value, ModelShape):
            payload.update((name, getattr(value, name)) for name in RECORD_SHAPE_FIELDS)
        else:
            payload[f.name] = _to_wire(value)
    data: bytes = msgpack.packb({"v": PROTOCOL_VERSION, "k": kind, "d": payload}, use_bin_type=True)
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"{kind} record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    return data


_RECORD_BOUNDS = MsgpackBounds(
    max_bytes=MAX_RECORD_BYTES,
    max_str_len=MAX_RECORD_BYTES,
    max_bin_len=MAX_RECORD_BYTES,
    max_array_len=MAX_REGIONS + 16,
    max_map_len=64,
)


def decode(data: bytes, cls: type[T]) -> T:
    """Decode and strictly validate one value of type ``cls``; see the module docstring."""
    kind = _KINDS[cls]
    try:
        envelope = unpack_bounded(data, _RECORD_BOUNDS)
    except UnpackError as exc:
        raise RecordDecodeError(f"{kind} record: {exc}", reason=exc.reason) from exc
    if not isinstance(envelope, dict) or set(envelope) != {"v", "k", "d"}:
        raise RecordDecodeError(f"{kind} record has no pdserve envelope", reason="malformed")
    if envelope["v"] != PROTOCOL_VERSION:
        raise RecordDecodeError(
            f"{kind} record has protocol version {envelope['v']!r}, expected {PROTOCOL_VERSION}",
            reason="wrong_version",
        )
    if envelope["k"] != kind:
        raise RecordDecodeError(
            f"expected a {kind} record, found {envelope['k']!r}", reason="wrong_kind"
        )
    payload = envelope["d"]
    if not isinstance(payload, dict):
        raise RecordDecodeError(f"{kind} record body is not a map", reason="schema")
    try:
        return _build(cls, payload)
    except (TypeError, ValueError) as exc:
        raise RecordDecodeError(f"invalid {kind} record: {exc}", reason="schema") from exc


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type[T], payload: dict[str, Any]) -> T:
    hints = _hints(cast(type[Any], cls))
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    flat = {name for name in known if hints[name] is ModelShape}
    wire_names = (set(known) - flat) | (set(RECORD_SHAPE_FIELDS) if flat else set())
    unknown = set(payload) - wire_names
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name, spec in known.items():
        if name in flat:
            values[name] = _build_shape(payload)
        elif name in payload:
            values[name] = _convert(hints[name], payload[name], name)
        elif spec.default is dataclasses.MISSING:
            raise ValueError(f"missing field {name!r}")
    return cls(**values)


def _build_shape(payload: dict[str, Any]) -> ModelShape:
    """The :class:`ModelShape` a record carries flat (:data:`RECORD_SHAPE_FIELDS`)."""
    hints = _hints(ModelShape)
    values: dict[str, Any] = {}
    for name in RECORD_SHAPE_FIELDS:
        if name in payload:
            values[name] = _convert(hints[name], payload[name], name)
        elif name not in _SHAPE_FIELDS_ADDED:
            raise ValueError(f"missing field {name!r}")
    return ModelShape(**values)


def _convert(expected: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(expected)
    if expected is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected bool")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected int")
        return value
    if expected is str:
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected str")
        return value
    if expected is bytes:
        if not isinstance(value, bytes):
            raise TypeError(f"{name}: expected bytes")
        return value
    if expected is Range:
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise TypeError(f"{name}: expected [start, stop]")
        return Range(value[0], value[1])
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return expected(value)
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(expected)
        if not isinstance(value, list):
            raise TypeError(f"{name}: expected a list")
        return tuple(_convert(item_type, item, name) for item in value)
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"{name}: unions are not part of the wire format")
    raise TypeError(f"{name}: unsupported wire type {expected!r}")


__all__ = [
    "KV_LAYOUT_HNC",
    "KV_LAYOUT_HND",
    "KV_REGIONS_PER_LAYER",
    "MAX_RECORD_BYTES",
    "PROTOCOL_VERSION",
    "RECORD_SHAPE_FIELDS",
    "EngineId",
    "EngineLoad",
    "EngineRecord",
    "EngineRole",
    "EngineState",
    "EngineStatus",
    "Event",
    "EventKind",
    "Generation",
    "HandshakeRecord",
    "compute_compat_hash",
    "decode",
    "encode",
    "kv_block_len",
    "record_shape",
    "validate_identifier",
]

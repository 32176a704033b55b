"""A vLLM worker's forward-pass thread is back on its rank's cores after vLLM's NIXL worker
pinned it to the machine's last core (``rank_binding_kept``), in a process of its own: the
helper re-binds the thread it runs in, and only that one."""

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
    kept = sorted(os.sched_getaffinity(0))
    others = sorted(sorted(os.sched_getaffinity(t.native_id)) for t in (earlier, later))
    with rank_binding_kept(0, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}):
        os.sched_setaffinity(0, {last})
    restored = sorted(os.sched_getaffinity(0))
    stop.set()
    print(json.dumps({"first": first, "last": last, "kept": kept, "others": others,
                      "restored": restored}))
    """
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin apart")
def test_the_pinned_thread_ends_on_its_ranks_cores_and_no_other_moves() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    result = json.loads(done.stdout)
    first, last = result["first"], result["last"]
    assert result["kept"] == [first], result
    # The others stay where they were: the one started before unbound, the later one where
    # the pin put it (moving them onto the forward pass's core slowed the engines).
    assert len(result["others"]) == 2 and [last] in result["others"], result
    assert sorted(os.sched_getaffinity(0)) in result["others"], result
    # vLLM's own modes (auto, nobind): the pinned thread gets back what it had.
    assert result["restored"] == [first]


def test_rank_cpus_reads_each_ranks_cores() -> None:
    assert rank_cpus("0-2|3,5") == [frozenset({0, 1, 2}), frozenset({3, 5})]
    assert rank_cpus("0|1|0") == [frozenset({0}), frozenset({1}), frozenset({0})]
    assert rank_cpus("auto") is None
    assert rank_cpus("nobind") is None
    assert rank_cpus("3-1") is None

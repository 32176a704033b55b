"""The serving process's collector policy: start-up's objects frozen, later cycles collected."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from services.lifetime import SERVING_GC_THRESHOLDS


def test_freeze_startup_heap_skips_what_start_up_left_and_still_collects_later_cycles() -> None:
    # In its own process: freezing is for the whole interpreter (never pytest's).
    script = textwrap.dedent(
        """
        import gc, json, weakref
        from services.lifetime import freeze_startup_heap

        class Node:
            pass

        def cycle():
            node = Node()
            node.self = node
            return node

        kept = [cycle() for _ in range(100)]
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        after = cycle()
        gone = weakref.ref(after)
        del after
        gc.collect()
        print(json.dumps({
            "frozen": frozen,
            "later_cycle_collected": gone() is None,
            "thresholds": list(gc.get_threshold()),
        }))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(result.stdout)
    assert report["frozen"] > 100  # at least the kept cycles, and the modules
    assert report["later_cycle_collected"] is True
    assert report["thresholds"] == list(SERVING_GC_THRESHOLDS)


def test_a_serving_process_collects_nothing_while_it_starts_and_its_forks_collect() -> None:
    script = textwrap.dedent(
        """
        import gc, json, os
        from services.lifetime import collection_deferred_until_serving, freeze_startup_heap

        def forked():  # a rank: does it collect, over a frozen heap?
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(write, json.dumps([gc.isenabled(), gc.get_freeze_count()]).encode())
                os._exit(0)
            os.waitpid(pid, 0)
            return json.loads(os.read(read, 1000))

        with collection_deferred_until_serving():
            starting = gc.isenabled()
            child = forked()
            freeze_startup_heap()
            serving = gc.isenabled()
        gc.unfreeze()
        with collection_deferred_until_serving():
            pass  # an entry point that returned before serving (a test's bad flags)
        after = gc.isenabled()
        print(json.dumps({
            "starting": starting, "child": child, "serving": serving, "after": after,
            "fork_after": forked(),
        }))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    report = json.loads(result.stdout)
    assert report["starting"] is False
    child_enabled, child_frozen = report["child"]
    assert child_enabled is True and child_frozen > 1000  # the parent's modules, frozen
    assert report["serving"] is True
    # Returned without serving: the collector is back, and a later fork is left as it is.
    assert report["after"] is True
    assert report["fork_after"] == [True, 0]

"""Nothing a process starts outlives it, however it ends (SIGKILL and the OOM killer included).

Two mechanisms, one for each way pdserve starts a process:

- **An exec'd command** (an engine host, the router, Redis, Prometheus: what ``pdserve up``
  starts): :func:`parent_death_preexec` is the ``preexec_fn`` that sets Linux's
  ``PR_SET_PDEATHSIG`` in the child between fork and exec, so the kernel sends it ``SIGTERM``
  (its own clean stop) when its parent ends. The kernel ties the signal to the *thread* that
  forked, not the process: start such children from the main thread (``ChildProcess`` only
  asks for it there).
- **A Python process pdserve spawns with ``multiprocessing``, or vLLM does** (reference-engine
  ranks, vLLM's engine core): :func:`exit_with_parent`, called first thing in the child,
  watches the parent through a pidfd on a daemon thread. When the parent is gone the process
  sends itself ``SIGTERM`` (its own clean stop) and, ``grace_s`` later, ``SIGKILL``. This one
  does not depend on which thread of the parent started it.

Where neither kernel feature exists (not Linux, or a kernel without pidfds), the watch polls
``os.getppid()`` instead: a parent watch, as the issue's "where that cannot be used" asks.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``<sys/prctl.h>``: the signal the calling process gets when its parent (thread) ends."""

POLL_INTERVAL_S = 0.5
"""How often the fallback watch (no pidfd) reads ``os.getppid()``."""

WATCH_PARENT_ENV = "PDSERVE_EXIT_WITH_PARENT"
"""Set by an engine host to its own pid before vLLM starts its processes: vLLM's engine core,
whose parent that pid is, then calls :func:`exit_with_parent` (the ``pdserve`` vLLM plugin,
:mod:`services.engines.vllm.plugin`). Other processes that load the plugin (the host itself,
vLLM's workers, which watch the engine core through vLLM's own death pipe) are not its
children and ignore it."""

_LINUX = sys.platform.startswith("linux")
_prctl: Callable[..., int] | None = None
if _LINUX:
    # Resolved here, in the parent: the child between fork and exec only makes the call.
    _prctl = ctypes.CDLL(None, use_errno=True).prctl


def parent_death_preexec(
    sig: signal.Signals = signal.SIGTERM, then: Callable[[], None] | None = None
) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when this process ends.
    ``then`` runs after it in the child (another preexec step, e.g. CPU pinning). A parent
    already gone when the child gets there (the race between fork and prctl) ends the child at
    once. Off Linux, or called from another thread than the main one (the kernel would signal
    the child when *that thread* ends), it is only ``then``."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return then
    prctl = _prctl
    parent = os.getpid()

    def preexec() -> None:
        # Async-signal-safe enough: one C call through a function resolved before the fork.
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        if then is not None:
            then()

    return preexec


def exit_with_parent(grace_s: float, *, name: str) -> threading.Thread | None:
    """Watch this process's parent from a daemon thread: when it is gone, ``SIGTERM`` to this
    process, then ``SIGKILL`` after ``grace_s`` if it is still there. Returns the thread, or
    ``None`` when the process has no parent left to watch (already orphaned: it stops at
    once, the same way). ``name`` names the process in the log line."""
    parent = os.getppid()
    if parent <= 1:
        _parent_gone(parent, grace_s, name)
        return None
    thread = threading.Thread(
        target=_watch, args=(parent, grace_s, name), name="pdserve-parent-watch", daemon=True
    )
    thread.start()
    return thread


def _watch(parent: int, grace_s: float, name: str) -> None:
    try:
        pidfd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): poll
        while os.getppid() == parent:
            time.sleep(POLL_INTERVAL_S)
    else:
        try:
            if os.getppid() == parent:  # still the same process behind the pidfd
                select.select([pidfd], [], [])  # readable once the process has exited
        finally:
            os.close(pidfd)
    _parent_gone(parent, grace_s, name)


def end_stop_within(bound_s: float, *, name: str) -> threading.Timer:
    """The backstop of a clean stop that started now: if the process still runs ``bound_s``
    later (a drain or a backend stop that hangs), it is killed, with its process group when
    it leads one (a ``pdserve up`` child does: its ranks or vLLM's processes go with it).
    Returns the daemon timer (already started)."""

    def overran() -> None:
        logger.error("%s did not stop within %.0fs of being told to; killing it", name, bound_s)
        sys.stderr.flush()
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    timer = threading.Timer(bound_s, overran)
    timer.name = "pdserve-stop-bound"
    timer.daemon = True
    timer.start()
    return timer


def _parent_gone(parent: int, grace_s: float, name: str) -> None:
    logger.error(
        "%s: parent process %d is gone; stopping (SIGKILL in %.0fs)", name, parent, grace_s
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    logger.error("%s: still running %.0fs after its parent ended; killing it", name, grace_s)
    os.kill(os.getpid(), signal.SIGKILL)

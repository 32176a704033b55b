"""Child processes of pdserve's own tools: the one supervisor of ``pdserve up``, the benchmarks
and the end-to-end test harnesses.

- :mod:`~services.supervision.child`: :class:`ChildProcess` (start a command in a session of
  its own with its environment and log file, read its ``PDSERVE_READY`` line, stop it: SIGTERM,
  a bounded wait, then SIGKILL of its process group; start it again) and
  :func:`stop_in_order`;
- :mod:`~services.supervision.restarts`: :class:`RestartPolicy` and :class:`RestartTracker`,
  the restart / back-off / crash-loop state machine of ``pdserve up``;
- :mod:`~services.supervision.detached`: :class:`DetachedProcess`, a whole ``pdserve up`` run
  from synchronous code (benchmarks, tests): started with its output in a file, stopped with
  Ctrl-C (SIGINT), a bounded wait, then SIGKILL of its process group.

It sits above ``serving`` (whose :func:`~services.serving.ready.parse_ready_line` it reads) and
below the packages that start processes (``bench``, ``cli``; the tests).
"""

from services.supervision.child import ChildExited, ChildProcess, Output, stop_in_order
from services.supervision.detached import DetachedProcess
from services.supervision.restarts import Decision, RestartPolicy, RestartTracker

__all__ = [
    "ChildExited",
    "ChildProcess",
    "Decision",
    "DetachedProcess",
    "Output",
    "RestartPolicy",
    "RestartTracker",
    "stop_in_order",
]

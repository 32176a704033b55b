"""A process whose work is done ends without the interpreter's finalization.

Python's own exit, after the ``atexit`` handlers, tears every module down and runs a last
garbage collection over what is left: for an engine host (torch, gRPC, the engine's objects)
that is about a second of CPU spent freeing memory the kernel takes back anyway, five to eight
seconds of wall time on a loaded machine, at every stop. :func:`end_process` does everything a
normal exit does that anyone can observe, then leaves with ``os._exit``:

1. runs :mod:`threading`'s shutdown, as the interpreter's does: the callbacks registered there
   first (an executor that was never shut down tells its idle workers to leave, which a plain
   join of them would wait on forever), then a join of every non-daemon thread;
2. runs the ``atexit`` handlers (``logging.shutdown`` flushes and closes every log handler,
   :mod:`multiprocessing` joins its non-daemon children and terminates its daemonic ones,
   ``weakref.finalize`` callbacks marked to run at exit run);
3. flushes standard output and standard error.

What it skips is the module teardown and the final collection: ``__del__`` methods of objects
still alive at exit. Call it only once the process has released what it holds (servers
stopped, children reaped, registrations withdrawn), as a clean stop has.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def end_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` as a normal exit would, less the
    interpreter's finalization (see the module docstring). Never returns."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # A stream already closed (or replaced by None) has nothing left to flush.
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    os._exit(code)

"""The ``pdserve`` vLLM general plugin: vLLM's engine core ends with the engine host that
started it, however the host ends (SIGKILL included).

vLLM loads every ``vllm.general_plugins`` entry point once in each of its processes (the host's
``AsyncLLM``, the engine core, each worker); pdserve's (``pyproject.toml``) is :func:`register`.
The host sets :data:`~services.lifetime.WATCH_PARENT_ENV` to its own pid before vLLM starts its
processes (:class:`~services.engines.vllm.backend.VllmBackend`); a process whose parent is that
pid (the engine core) then watches it (:func:`~services.lifetime.exit_with_parent`: SIGTERM,
vLLM's own clean shutdown that ends its workers, then SIGKILL after :data:`ENGINE_CORE_GRACE_S`).
vLLM's workers watch the engine core themselves (vLLM's death pipe). vLLM forks its engine core
and workers (on GPUs by default, on CPUs as pdserve asks: ``VllmEngineOptions.start_method``);
a forked child inherits the host's loaded plugins and never loads them again, so
:func:`register` also hooks the host's forks: the engine core starts its watch there, and each
forked vLLM process sends pdserve's log lines where vLLM's go
(:func:`~services.engines.vllm._vllm_process.log_through_vllm`), not through the host's logging
configuration it inherited.

``VLLM_PLUGINS``, when a user sets it, must name ``pdserve`` for this to load.
"""

from __future__ import annotations

import functools
import os

from services.lifetime import WATCH_PARENT_ENV, exit_with_parent

ENGINE_CORE_GRACE_S = 15.0
"""From vLLM's SIGTERM shutdown of the engine core to SIGKILL."""


def register() -> None:
    """The entry point vLLM calls in each of its processes (see the module docstring)."""
    watch_if_child_of_host()
    _hook_forks()


@functools.cache
def _hook_forks() -> None:
    """Once a process: its forked children check too."""
    os.register_at_fork(after_in_child=_in_forked_child)


def _in_forked_child() -> None:
    watch_if_child_of_host()
    if os.environ.get(WATCH_PARENT_ENV):  # a process of a vLLM engine host's tree
        from services.engines.vllm._vllm_process import log_through_vllm  # noqa: PLC0415

        log_through_vllm(inherited=True)


def watch_if_child_of_host() -> None:
    """Watch the parent when it is the engine host that asked for it."""
    host = os.environ.get(WATCH_PARENT_ENV)
    if host and host.isdigit() and int(host) == os.getppid():
        exit_with_parent(ENGINE_CORE_GRACE_S, name="vLLM engine core")

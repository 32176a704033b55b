"""The NIXL boundary: every NIXL call pdserve makes, each translated by :func:`map_nixl_errors`.

NIXL (and torch, for the registered buffer) is imported here and only when an agent is built.
Above this module nothing sees a NIXL exception, only the errors of
:mod:`services.kv_transfer.errors`.

NIXL/UCX behaviour the data plane relies on (measured with nixl 1.5.1, UCX backend, CPU only):

- Reads between processes on one host go through UCX ``cma`` (``process_vm_readv``): the
  producer's CPU is not involved once connected. Notifications travel over UCX ``tcp`` on
  loopback. No environment variable is needed (``UCX_TLS`` left unset).
- NIXL's progress thread busy-polls a whole core, so it is off by default (:class:`NixlConfig`).
  Without it the consumer progresses its reads when it checks them, and the producer
  progresses connection set-up when it fetches notifications: ``make_connection`` returns at
  once and the consumer's first read waits until the producer next polls. A ``send_notif`` to
  a peer whose connection is still being set up is queued in UCX and leaves only while the
  sender progresses (a read check or a notification fetch): stop polling and it never arrives.
- Once connected, a read of an established peer often completes inside ``transfer``.
- A dead peer makes ``transfer``, ``check_xfer_state`` and ``send_notif`` raise
  ``nixlRemoteDisconnectError`` within milliseconds (UCX peer error handling, the UCX backend's
  default); loading a dead agent's metadata raises ``nixlBackendError`` (connection refused).
- Releasing an in-flight transfer handle aborts it without error.
- ``add_remote_agent`` returns the agent name as ``bytes``.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from services.kv_transfer.errors import TransportFatalError, map_nixl_errors

if TYPE_CHECKING:
    import torch

Handle = Any
"""An opaque NIXL handle (prepared descriptor list or transfer request)."""


@dataclass(frozen=True)
class NixlConfig:
    """How the NIXL agent is built. The defaults suit a CPU box."""

    backends: tuple[str, ...] = ("UCX",)
    progress_thread: bool = False
    """NIXL's progress thread; it spins a whole core, so only where cores are plentiful."""
    num_workers: int = 1
    """UCX workers of the backend (its ``num_workers`` parameter)."""
    num_threads: int = 0
    """UCX backend threads (its ``num_threads`` parameter); 0 keeps the backend's default."""

    def backend_params(self, backend: str) -> dict[str, str]:
        params: dict[str, str] = {}
        if backend == "UCX":
            if self.num_workers != 1:
                params["num_workers"] = str(self.num_workers)
            if self.num_threads > 0:
                params["num_threads"] = str(self.num_threads)
        return params


def _import_nixl_api() -> Any:
    try:
        from nixl import _api  # noqa: PLC0415 - heavy optional dependency, loaded when selected
    except ImportError as exc:
        raise TransportFatalError(
            "the NIXL transport needs the 'nixl' package (pip install nixl==1.5.1)"
        ) from exc
    _quiet_nixl_logging()
    return _api


def _quiet_nixl_logging() -> None:
    """NIXL configures its ``nixl`` logger to print INFO to stdout, which corrupts the JSON our
    commands print there: send it to stderr at WARNING (raise it with ``logging`` if needed)."""
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if nixl_logger.level < logging.WARNING:
        nixl_logger.setLevel(logging.WARNING)


class NixlAgent:
    """One NIXL agent with one registered buffer. Not thread-safe (sync mode NONE)."""

    def __init__(self, name: str, config: NixlConfig, buffer: torch.Tensor) -> None:
        """Create the agent and its backends and register ``buffer`` (contiguous).

        Raises :class:`TransportFatalError` when NIXL is missing, a backend plugin is not
        available or registration fails.
        """
        api = _import_nixl_api()
        self.name = name
        with map_nixl_errors(f"create NIXL agent {name}", fatal=True):
            self._agent = api.nixl_agent(
                name, api.nixl_agent_config(enable_prog_thread=config.progress_thread, backends=[])
            )
            for backend in config.backends:
                if backend not in self._agent.get_plugin_list():
                    raise TransportFatalError(f"NIXL backend plugin {backend!r} is not available")
                self._agent.create_backend(backend, config.backend_params(backend))
            self._registration = self._agent.register_memory(buffer)

    def metadata(self) -> bytes:
        with map_nixl_errors("get agent metadata", fatal=True):
            metadata: bytes = self._agent.get_agent_metadata()
        return metadata

    def add_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata and start connecting to it; its name."""
        with map_nixl_errors("add remote agent"):
            loaded = self._agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            self._agent.make_connection(name)
        return name

    def remove_remote(self, agent: str) -> None:
        with map_nixl_errors(f"remove remote agent {agent}"):
            self._agent.remove_remote_agent(agent)

    def prep_dlist(
        self, agent: str | None, rows: npt.NDArray[np.uint64], memory_type: str
    ) -> Handle:
        """Prepare ``rows`` (``address, length, device``) of ``agent``'s memory, or of local
        memory when ``agent`` is None."""
        with map_nixl_errors(f"prepare descriptors of {agent or 'local memory'}"):
            return self._agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", rows, memory_type)

    def read(
        self,
        local: Handle,
        local_indices: npt.NDArray[np.int32],
        remote: Handle,
        remote_indices: npt.NDArray[np.int32],
    ) -> Handle:
        """Build a READ of the selected descriptors (not posted yet)."""
        with map_nixl_errors("make read request"):
            return self._agent.make_prepped_xfer(
                "READ", local, local_indices, remote, remote_indices
            )

    def post(self, handle: Handle) -> str:
        """Post a transfer: ``DONE``, ``PROC`` or ``ERR``."""
        with map_nixl_errors("post transfer"):
            state: str = self._agent.transfer(handle)
        return state

    def state(self, handle: Handle) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (progresses the agent)."""
        with map_nixl_errors("check transfer"):
            state: str = self._agent.check_xfer_state(handle)
        return state

    def release(self, handle: Handle) -> None:
        """Release a transfer or descriptor-list handle (aborting a transfer in flight)."""
        with map_nixl_errors("release handle"):
            handle.release()

    def notify(self, agent: str, message: bytes) -> None:
        with map_nixl_errors(f"notify {agent}"):
            self._agent.send_notif(agent, message)

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender (progresses the agent)."""
        with map_nixl_errors("get notifications"):
            received: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return received

    def deregister(self) -> None:
        with map_nixl_errors("deregister memory"):
            self._agent.deregister_memory(self._registration)

"""The seam between the engine host and a role's gRPC service.

The host (:mod:`services.serving.host.engine_host`) is the same for both roles; what differs is the
service it serves beside ``EngineService`` and Health. A role package (:mod:`services.prefill`,
:mod:`services.decode`) hands the host a :class:`RoleService`; the host never imports a role package
(a lower layer never imports a higher one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from google.protobuf.descriptor import ServiceDescriptor

from services.control_plane.wire import EngineRole
from services.engines.producer_check import ProducerViews
from services.serving.host.servicer import ServingState


class RoleService(ABC):
    """One role's gRPC service, as the engine host serves it.

    Contract: :attr:`role` is the role the engine registers under; :attr:`descriptor` is the
    proto service (its full name is also the Health service name the host reports);
    :meth:`servicer` is called once, after ``backend.describe()`` and before the server starts,
    and returns the object whose same-named methods serve every method of :attr:`descriptor`
    (registered through :func:`services.serving.host.handlers.add_servicer`).
    """

    role: EngineRole
    descriptor: ServiceDescriptor

    @abstractmethod
    def servicer(self, state: ServingState, producer_views: ProducerViews) -> object:
        """The servicer over ``state`` (``producer_views``: the host's view of the producers,
        for a role that consumes KV)."""

"""The prefill role as the engine host serves it
(:class:`~services.serving.host.role.RoleService`)."""

from __future__ import annotations

from services.control_plane.wire import EngineRole
from services.engines.producer_check import ProducerViews
from services.prefill.servicer import PrefillServicer
from services.proto_gen.pdserve.v1 import prefill_pb2
from services.serving.host.role import RoleService
from services.serving.host.servicer import ServingState


class PrefillService(RoleService):
    """``pdserve.v1.PrefillService`` served by :class:`PrefillServicer`."""

    role = EngineRole.PREFILL
    descriptor = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"]

    def servicer(self, state: ServingState, producer_views: ProducerViews) -> PrefillServicer:
        return PrefillServicer(state)

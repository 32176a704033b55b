"""The decode role as the engine host serves it
(:class:`~services.serving.host.role.RoleService`)."""

from __future__ import annotations

from services.control_plane.wire import EngineRole
from services.decode.servicer import DecodeServicer, ProducerGate
from services.engines.producer_check import ProducerViews
from services.proto_gen.pdserve.v1 import decode_pb2
from services.serving.host.role import RoleService
from services.serving.host.servicer import ServingState


class DecodeService(RoleService):
    """``pdserve.v1.DecodeService`` served by :class:`DecodeServicer`, its handles' producers
    checked by a :class:`ProducerGate` over the host's producer views (the one owner of the
    producer check; see :meth:`services.engines.backend.EngineBackend.decode`)."""

    role = EngineRole.DECODE
    descriptor = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]

    def servicer(self, state: ServingState, producer_views: ProducerViews) -> DecodeServicer:
        description = state.description
        gate = ProducerGate(
            producer_views,
            compat_hash=description.compat_hash,
            block_size=description.shape.block_size,
        )
        return DecodeServicer(state, gate)

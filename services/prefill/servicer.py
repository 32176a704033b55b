"""The Prefill RPC: validate, prefill on the backend, return the first token and the KV handle."""

from __future__ import annotations

import grpc.aio

from services.engines.errors import InvalidRequest, RequestAborted
from services.engines.requests import FinishReason
from services.proto_gen.pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from services.serving.host.servicer import ServingState
from services.serving.wire import convert
from services.serving.wire.trace_metadata import from_metadata


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """``pdserve.v1.PrefillService`` over an engine backend (status codes in prefill.proto)."""

    def __init__(self, state: ServingState) -> None:
        self.state = state

    async def Prefill(  # noqa: N802 (gRPC method name)
        self,
        request: prefill_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext[prefill_pb2.PrefillRequest, prefill_pb2.PrefillResponse],
    ) -> prefill_pb2.PrefillResponse:
        async with self.state.rpc("Prefill", context) as outcome:
            call = convert.prefill_request_from_proto(
                request, self.state.limits, trace=from_metadata(context.invocation_metadata())
            )
            outcome.request_id = call.request_id
            if call.sampling.n > 1 and not self.state.backend.forks_decode:
                raise InvalidRequest(
                    f"engine {self.state.engine_id} samples one choice per prefill: n must be 1"
                )
            result = await self.state.backend.prefill(call)
            if result.finish_reason is FinishReason.ABORT:
                raise RequestAborted(f"prefill of {call.request_id} was aborted")
            self.state.metrics.prefill_seconds.labels(self.state.engine_id).observe(
                result.prefill_s
            )
            return convert.prefill_result_to_proto(result)
        raise AssertionError("unreachable: rpc() aborts the call on error")

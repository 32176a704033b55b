"""A gRPC client on HTTP/2 frames handled on the event loop (:class:`H2GrpcChannel`), for the
router's hot path: see :mod:`services.serving.h2grpc.channel`."""

from services.serving.h2grpc.channel import H2GrpcChannel, client_ssl_context
from services.serving.h2grpc.errors import CallFailed
from services.serving.h2grpc.http2_base import STREAM_WINDOW

__all__ = ["STREAM_WINDOW", "CallFailed", "H2GrpcChannel", "client_ssl_context"]

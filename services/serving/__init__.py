"""The gRPC edge between the router and the engines, both ends of it:

- ``host/``: what ``pdserve prefill`` / ``pdserve decode`` run: the engine host (registration,
  heartbeat, READY wait, drain), the servicers' shared parts, the seam a role hands the host;
- ``wire/``: the proto (``pdserve.v1``) <-> seam-type conversions, the one table between engine
  errors and gRPC status codes, the trace context as call metadata;
- ``client/``: the seam every caller goes through
  (:class:`~services.serving.client.connector.EngineConnector`) and its two gRPC clients, the
  router's own over ``h2grpc/`` (the default) and grpc.aio's;
- ``errors``, ``tls`` and ``ready`` (the ``PDSERVE_READY`` line), which both ends share.
"""

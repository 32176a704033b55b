"""Code the prefill and decode services share: proto <-> backend conversions, the gRPC
servicers' common parts, the engine host (registration, heartbeat, drain), and the
:class:`~services.serving.client.EngineClient` the router calls engines with.
"""

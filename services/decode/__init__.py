"""The decode service: :mod:`~services.decode.servicer` (``pdserve.v1.DecodeService`` and the
producer gate).

``pdserve decode`` (:mod:`services.serving.cli`) runs it through the engine host both roles
share (:mod:`services.serving.host`: registration, heartbeat, health, drain, settings, metrics).
"""

"""The decode service: :mod:`~services.decode.servicer` (``pdserve.v1.DecodeService`` and the
producer gate), handed to the engine host as :class:`~services.decode.service.DecodeService`.

``pdserve decode`` (:mod:`services.cli.engine`) runs it through the engine host both roles share
(:mod:`services.serving.host.engine_host`: registration, heartbeat, health, drain, settings,
metrics).
"""

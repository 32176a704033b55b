"""The prefill service: :mod:`~services.prefill.servicer` (``pdserve.v1.PrefillService``),
handed to the engine host as :class:`~services.prefill.service.PrefillService`.

``pdserve prefill`` (:mod:`services.cli.engine`) runs it through the engine host both roles share
(:mod:`services.serving.host.engine_host`: registration, heartbeat, health, drain, settings,
metrics).
"""

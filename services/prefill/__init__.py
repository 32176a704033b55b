"""The prefill service: :mod:`~services.prefill.servicer` (``pdserve.v1.PrefillService``).

``pdserve prefill`` (:mod:`services.serving.cli`) runs it through the engine host both roles
share (:mod:`services.serving.host`: registration, heartbeat, health, drain, settings, metrics).
"""

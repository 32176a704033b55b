"""The vLLM engine (GPU): a KV connector whose handshake goes through the control plane, and the
``vllm`` engine backend.

Importing this package is light: nothing here imports vLLM or torch or opens a connection.
vLLM itself is imported only where it is used (:mod:`services.engines.vllm._connector_impl`,
:class:`services.engines.vllm.backend.VllmBackend.start`), and a missing vLLM is a clear
:class:`~services.engines.errors.EngineFailed` there (install the ``vllm`` extra).

- :mod:`layouts`     which PP x TP layouts vLLM 0.32.0's NIXL transfer path supports (pure)
- :mod:`handshake`   vLLM handshake payloads <-> control-plane records; the Redis bridge
- :mod:`contracts`   exactly-once transfer reports, the model-runner rule (pure)
- :mod:`connector`   the module vLLM loads via ``kv_connector_module_path`` (lazy classes)
- :mod:`backend`     :class:`VllmBackend`, the :class:`EngineBackend` over ``AsyncLLM``
"""

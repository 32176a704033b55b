"""vLLM's own OpenAI front end over pdserve's PD executor: the router's front end.

- :mod:`.config`        vLLM's server flags, config, renderer and input processor, no engine
- :mod:`.engine_client` vLLM's ``EngineClient`` over :class:`~services.router.execution.Executor`
- :mod:`.app`           vLLM's app (routes, middleware, errors) with pdserve's health, metrics
                        and ``x-pdserve-*`` headers

Importing these modules imports vLLM: the router imports them lazily, after
:func:`services.engines.vllm.version_guard.check_vllm`.
"""

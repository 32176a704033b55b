"""The OpenAI front end: HTTP in, a validated request out, the answer back in OpenAI's shape.

vLLM's own serving code (:mod:`.vllm`) over pdserve's executor; pdserve's ``/health`` and
``/metrics`` (:mod:`.ops`), what each engine kind honours (:mod:`.engine_support`), the
request's trace context (:mod:`.trace_headers`) and uvicorn's write coalescing
(:mod:`.http_protocol`). Below it: :mod:`..execution`.
"""

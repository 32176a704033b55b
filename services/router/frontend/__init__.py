"""The OpenAI front end: HTTP in, a validated request out, the answer back in OpenAI's shape.

pdserve's own (``api``, ``protocol``, ``params``, ``chat``, ``responses``, ``choices``, the lean
``direct_route`` and ``hot_path``) and vLLM's (:mod:`.vllm`). Below it: :mod:`..execution`.
"""

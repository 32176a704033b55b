"""Engines: the model runtimes that prefill and decode services host.

``services.engines.reference`` is the CPU reference engine's model half (plain torch, HF
Llama-family checkpoints, paged KV cache, PP x TP shards). Errors of every engine live in
``services.engines.errors``.
"""

"""The CPU reference engine: a Llama-family decoder in plain torch, served by rank processes.

Runtime (start at ``backend``):

- ``backend``: ``ReferenceBackend``, the :class:`~services.engines.backend.EngineBackend`;
- ``options``: ``ReferenceEngineOptions``;
- ``engine``: the host thread driving the scheduler and the ranks;
- ``scheduler``: admission, continuous batching, sampling, KV hand-off (pure bookkeeping);
- ``request_state``: a request's state in the scheduler, the planned step, block arithmetic;
- ``kv_blocks``: ``KVBlocks``, which blocks a request holds (allocator, prefix cache);
- ``outputs``: ``TokenRules`` (next token, finish rules) and the results a sequence returns;
- ``kv_handoff``: the held handle, the pull command, a failed pull's error, a lease's outcome;
- ``sampling``: seeded sampling and incremental detokenization with stop strings;
- ``executor``: the rank processes (start, broadcast, events, death detection);
- ``rank``: one ``(pp_rank, tp_rank)`` process (gloo, shard, KV pool, NIXL, handshake);
- ``messages``: what host and ranks tell each other; ``metrics``: host counters, rank relay.

Model:

- ``config``: ``ModelConfig`` from an HF ``config.json``;
- ``sharding``: the PP x TP cut (``ShardSpec`` -> ``ShardGeometry``);
- ``batch``: one step's ``ForwardBatch`` of ``SequenceChunk`` and the ``PagedKVCache``;
- ``layers``, ``model``: ``LlamaShard``, one shard of the decoder;
- ``loader``: ``load_model`` / ``load_weights`` from local safetensors;
- ``tokenizer``: ``Tokenizer`` (``tokenizer.json`` or a byte fallback) and the chat template;
- ``tiny_model``: a deterministic tiny random checkpoint (``pdserve make-tiny-model``).

Nothing is imported here, so importing only the tokenizer (as the router does) does not load
torch.
"""

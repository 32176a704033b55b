"""The CPU reference engine's model half: a Llama-family decoder in plain torch.

- ``config``: ``ModelConfig`` from an HF ``config.json``;
- ``sharding``: the PP x TP cut (``ShardSpec`` -> ``ShardGeometry``);
- ``batch``: one step's ``ForwardBatch`` of ``SequenceChunk`` and the ``PagedKVCache``;
- ``layers``, ``model``: ``LlamaShard``, one shard of the decoder;
- ``loader``: ``load_model`` / ``load_weights`` from local safetensors;
- ``tokenizer``: ``Tokenizer`` (``tokenizer.json`` or a byte fallback) and the chat template;
- ``local_group``: every shard of a layout in one process (tests, tools);
- ``tiny_model``: a deterministic tiny random checkpoint (``pdserve make-tiny-model``).

Nothing is imported here, so importing only the tokenizer (as the router does) does not load
torch.
"""

"""pdserve's own key of a KV block: its whole prefix's token ids, chained.

Engines name blocks by their own hashes (vLLM's depend on a seed and a hash algorithm); whoever
follows their events (the router's index, ``pdserve bench routing``'s oracle) keys blocks by
the token ids instead, so a prompt's keys are computed from the prompt alone and two engines'
blocks of one prefix have one key. Key ``i`` of a prompt chains key ``i - 1`` with block ``i``'s
token ids, from a root (:func:`chain_root`: the model and LoRA adapter; ``0`` where one model
is all there is).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BlockKey = int
"""A block's key: its whole prefix's token ids, chained (:func:`block_keys`)."""


def chain_root(model: str, lora_name: str | None = None) -> BlockKey:
    """The key the first block chains on: the model and the LoRA adapter (a stable digest,
    not Python's ``hash`` of a string, which differs per process)."""
    digest = hashlib.blake2b(f"{model}\0{lora_name or ''}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def chain(previous: BlockKey, block: Sequence[int]) -> BlockKey:
    """The key of ``block`` after the block keyed ``previous``. Python's hash of a tuple of
    ints is the same in every process."""
    return hash((previous, tuple(block)))


def block_keys(token_ids: Sequence[int], block_size: int, root: BlockKey) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids``: key ``i`` covers ``[0, (i + 1) * block_size)``."""
    keys: list[BlockKey] = []
    previous = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = chain(previous, token_ids[start : start + block_size])
        keys.append(previous)
    return keys

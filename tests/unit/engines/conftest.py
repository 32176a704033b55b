"""Fixtures for the reference-engine tests: tiny checkpoints written once per session, and a
greedy-decoding driver over the paged KV cache."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.engines.reference.batch import SequenceChunk
from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from services.topology import EngineLayout
from tests.local_shard_group import LocalShardGroup

# Every checkpoint here is local; transformers must never reach the network. Set at import,
# before test modules import transformers (huggingface_hub reads it once, at its import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_SIZE = 4
NUM_BLOCKS = 64
# Non-contiguous, out-of-order block ids: a paging bug (reading block i as if it followed
# block i - 1) changes the logits.
BLOCK_TABLE = (17, 3, 40, 9, 0, 25, 12, 33, 6, 51, 21, 2, 45, 30, 8, 60, 11, 38, 27, 14)

Greedy = Callable[..., tuple[list[int], list[torch.Tensor]]]
MakeGroup = Callable[..., LocalShardGroup]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny Llama (7 layers, 4 heads over 2 KV heads, llama3 RoPE), one file."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen2 variant (q/k/v bias, tied embeddings), in three weight files with an index."""
    spec = TinyModelSpec(model_type="qwen2", num_weight_files=3)
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=1, spec=spec)


def run_greedy(
    group: LocalShardGroup, prompt: list[int], steps: int, table: tuple[int, ...] = BLOCK_TABLE
) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` then decode ``steps`` greedy tokens, one step each.

    Returns the generated tokens and the logits: ``[len(prompt), vocab]`` for the prefill, then
    ``[vocab]`` per decode step.
    """
    prefill = group.step([SequenceChunk(tuple(prompt), 0, table)], all_tokens=True)
    logits = [prefill]
    tokens: list[int] = []
    last = prefill[-1]
    for _ in range(steps):
        tokens.append(int(last.argmax()))
        num_cached = len(prompt) + len(tokens) - 1
        last = group.step([SequenceChunk((tokens[-1],), num_cached, table)])[0]
        logits.append(last)
    return tokens, logits


@pytest.fixture
def greedy() -> Greedy:
    """:func:`run_greedy`, as a fixture so test modules need not import this conftest."""
    return run_greedy


@pytest.fixture
def make_group() -> Iterator[MakeGroup]:
    """``make_group(directory, pp, tp, partition=None)``: a :class:`LocalShardGroup` of the
    uniform layout (7 layers, 2 KV heads), closed after the test."""
    groups: list[LocalShardGroup] = []

    def make(
        directory: Path, pp: int = 1, tp: int = 1, partition: list[int] | None = None
    ) -> LocalShardGroup:
        layout = EngineLayout.uniform(7, 2, pp, tp, partition)
        group = LocalShardGroup(directory, layout, NUM_BLOCKS, BLOCK_SIZE)
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.close()

"""Token selection and output text: per-request seeded sampling, stop strings, detokenization.

Both run in the engine's host process on the last stage's logits, one request at a time, so a
request's tokens depend only on its own logits and its own generator: with a ``seed`` the same
tokens come out whatever the layout or the other requests batched with it. A seeded request draws
output token ``i`` from :func:`token_generator` ``(seed, i)``, so the tokens are also the same
when the first token was sampled by a prefill engine and the rest by a decode engine.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from services.engines.backend import SamplingParams
from services.engines.reference.output_text import OutputText


def make_generator(seed: int | None) -> torch.Generator:
    """The request's own generator: seeded when asked, else from the OS entropy pool."""
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def token_generator(seed: int, position: int) -> torch.Generator:
    """The generator of output token ``position`` of a request seeded with ``seed``: a function
    of the two only, whichever engine samples that token."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest, "little") >> 1)
    return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from ``[vocab]`` logits: greedy, or temperature -> top-k -> top-p.

    Exactly one draw from ``generator`` per sampled token (none when greedy), so a seeded
    request is reproducible token by token.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.to(torch.float32) / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = ["OutputText", "make_generator", "sample_token", "token_generator"]

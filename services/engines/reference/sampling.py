"""Token selection and output text: per-request seeded sampling, stop strings, detokenization.

Both run in the engine's host process on the last stage's logits, one request at a time, so a
request's tokens depend only on its own logits and its own generator: with a ``seed`` the same
tokens come out whatever the layout or the other requests batched with it. A seeded request draws
output token ``i`` from :func:`token_generator` ``(seed, i)``, so the tokens are also the same
when the first token was sampled by a prefill engine and the rest by a decode engine, or when a
continuation (``SamplingParams.output_tokens_in_prompt``) samples the rest on other engines.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable, Sequence

import torch

from services.engines.requests import SamplingParams, TokenLogprobs
from services.tokenization.output_text import OutputText


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


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    stop_ids: Iterable[int],
) -> torch.Tensor:
    """The ``[vocab]`` logits the token is picked from, in vLLM's order: ``logit_bias``,
    ``min_tokens`` (``stop_ids``, EOS included, masked while fewer than ``min_tokens`` were
    generated), then the repetition (prompt and output), frequency and presence (output)
    penalties. ``output``: every output token so far, a producer's first token included, so
    a disaggregated request is penalized exactly as a colocated one; the frequency and
    presence penalties also count the prompt's last ``params.output_tokens_in_prompt`` tokens
    (a continuation's output from earlier legs)."""
    processed = logits.to(torch.float32)
    if params.logit_bias:
        processed = processed.clone()
        ids = torch.tensor([token for token, _ in params.logit_bias], dtype=torch.long)
        biases = torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32)
        processed.index_add_(0, ids, biases)
    if len(output) < params.min_tokens:
        blocked = sorted(set(stop_ids))
        if blocked:
            if processed is logits:
                processed = processed.clone()
            processed[torch.tensor(blocked, dtype=torch.long)] = float("-inf")
    if not params.penalized:
        return processed
    vocab = processed.shape[-1]
    earlier = params.output_tokens_in_prompt
    counted = [*prompt[len(prompt) - earlier :], *output] if earlier else list(output)
    counts = torch.bincount(torch.tensor(counted, dtype=torch.long), minlength=vocab)[:vocab]
    processed = processed.clone()
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt:
            seen |= (
                torch.bincount(torch.tensor(list(prompt), dtype=torch.long), minlength=vocab)[
                    :vocab
                ]
                > 0
            )
        penalty = params.repetition_penalty
        penalized = torch.where(processed > 0, processed / penalty, processed * penalty)
        processed = torch.where(seen, penalized, processed)
    processed -= params.frequency_penalty * counts.to(torch.float32)
    processed -= params.presence_penalty * (counts > 0).to(torch.float32)
    return processed


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s logprob in the raw ``[vocab]`` logits (before any processing: vLLM's
    default ``raw_logprobs``), its rank and the ``top`` most likely."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = float(logprobs[token])
    rank = int((logprobs > logprobs[token]).sum()) + 1
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return TokenLogprobs(token_id=token, logprob=chosen, rank=rank, top=best)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token from ``[vocab]`` (processed) logits: greedy, or temperature -> min-p ->
    top-k -> top-p.

    Exactly one draw from ``generator`` per sampled token (none when greedy), so a seeded
    request is reproducible token by token.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits.to(torch.float32) / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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

"""The reference scheduler's KV blocks: which blocks a request holds, reserves and gives back.

The scheduler (:mod:`~services.engines.reference.scheduler`) decides which request runs and
when; :class:`KVBlocks` decides which blocks it runs in, as vLLM's ``KVCacheManager`` does
beside its ``Scheduler``. It owns the engine-wide block allocator (so block ids are the same on
every rank, as in vLLM) and the prefix cache, when on; of a request it reads the prompt, kind,
sampling and forks and writes only its block fields (``block_ids``, ``reserved``,
``num_computed`` and ``cached_tokens`` at admission, ``cache_write_tokens``), never its phase.

A request gets every block it may need when it is admitted (no preemption): its own worst case
in ``block_ids``, its further forks' in ``reserved``, the prompt's cached prefix first. A fork
started from a pulled request shares the prompt's full blocks (one more reference each, never
written) and takes the rest of its blocks from that reservation.
"""

from __future__ import annotations

from services.engines.reference.prefix_cache import PrefixCache
from services.engines.reference.request_state import EngineRequest, SchedulerLimits
from services.kv_transfer.allocator import BlockAllocator


class KVBlocks:
    """See the module docstring. Not thread-safe: the engine loop's thread owns it."""

    def __init__(self, limits: SchedulerLimits, *, record_events: bool = False) -> None:
        self.limits = limits
        self.allocator = BlockAllocator(limits.num_blocks)
        self.prefix_cache = (
            PrefixCache(self.allocator, limits.block_size, record_events=record_events)
            if limits.prefix_caching
            else None
        )

    def free_count(self) -> int:
        """Blocks an admission may use (evictable prefix-cache blocks included)."""
        cache = self.prefix_cache
        return self.allocator.free_count if cache is None else cache.free_count()

    def reserve(self, request: EngineRequest) -> bool:
        """Give a waiting ``request`` every block it may need (see the module docstring), its
        cached prompt tokens counted as computed; ``False``, and nothing held, when they are
        not free."""
        limits, cache = self.limits, self.prefix_cache
        single = limits.blocks_needed(request.kind, len(request.prompt), request.sampling)
        needed = limits.blocks_total(
            request.kind, request.prompt, request.sampling, len(request.forks) + 1
        )
        cached: list[int] = []
        if cache is not None and request.sampling.prompt_logprobs is None:
            # A remote request's KV for every prompt token may be cached (its first token
            # is computed here anyway): only the blocks past the hit are pulled.
            cached = cache.match(
                (*request.prompt, request.first_token_id)
                if request.kind == "remote" and request.first_token_id is not None
                else request.prompt
            )
        if needed - len(cached) > self.free_count():
            if cached:
                self.allocator.free(cached)
            return False
        fresh = (
            cache.allocate(needed - len(cached))
            if cache is not None
            else list(self.allocator.allocate(needed))
        )
        blocks = [*cached, *fresh]
        request.block_ids, request.reserved = blocks[:single], blocks[single:]
        request.num_computed = request.cached_tokens = len(cached) * limits.block_size
        return True

    def prompt_computed(self, request: EngineRequest) -> None:
        """``request`` computed its prompt's KV: the prefix cache takes its full blocks."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.insert(request.prompt, request.block_ids)
        # vLLM's count: the prompt's full blocks, less those found cached.
        full = len(request.prompt) // self.limits.block_size * self.limits.block_size
        request.cache_write_tokens = max(0, full - request.cached_tokens)

    def prompt_pulled(self, request: EngineRequest) -> None:
        """``request``'s pulled blocks hold its prompt's KV: the prefix cache takes them."""
        if self.prefix_cache is not None:
            self.prefix_cache.insert(request.prompt, request.block_ids)

    def fork(self, request: EngineRequest) -> tuple[list[int], int]:
        """The blocks of one further fork of the pulled ``request`` (the prompt's full blocks
        shared, the rest from ``request``'s reservation) and how many tokens' KV they hold."""
        size = self.limits.block_size
        full = len(request.prompt) // size
        own = self.limits.blocks_needed("remote", len(request.prompt), request.sampling) - full
        shared = request.block_ids[:full]
        self.allocator.incref(shared)
        blocks, request.reserved = request.reserved[:own], request.reserved[own:]
        return [*shared, *blocks], full * size

    def release(self, request: EngineRequest) -> None:
        """Give back every block ``request`` holds or reserved."""
        if request.block_ids:
            self.allocator.free(request.block_ids)
            request.block_ids = []
        if request.reserved:
            self.allocator.free(request.reserved)
            request.reserved = []

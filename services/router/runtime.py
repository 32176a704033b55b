"""The router's long-lived parts, built once per process (in the app's lifespan)."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.config import RouterSettings
from services.router.execution.executor import Executor
from services.router.metrics import RouterMetrics
from services.router.scheduling.connector import ConnectorFactory
from services.router.scheduling.health import CircuitBreaker
from services.router.scheduling.kv_feed import KVEventFeed
from services.router.scheduling.kv_index import KVIndex
from services.router.scheduling.policies import make_policy
from services.router.scheduling.pool import EnginePool
from services.router.scheduling.scheduler import Scheduler
from services.tokenization.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


@dataclass
class RouterRuntime:
    """What request handlers reach through the ``Runtime`` dependency."""

    settings: RouterSettings
    metrics: RouterMetrics
    tokenizer: Tokenizer
    """The (first) served model's tokenizer (a migration's text so far; the front end has
    vLLM's); the executor has every model's."""
    pool: EnginePool
    scheduler: Scheduler
    executor: Executor
    api_keys: tuple[bytes, ...]
    kv_events: KVEventFeed | None = None
    """The subscriptions to the engines' KV events (``None``: ``kv_events`` off); closed
    with the runtime (:meth:`close`)."""

    async def close(self) -> None:
        """Stop what :meth:`build` started that the pool does not own (KV-event
        subscriptions)."""
        if self.kv_events is not None:
            await self.kv_events.close()

    @classmethod
    def build(
        cls,
        settings: RouterSettings,
        connectors: ConnectorFactory,
        metrics: RouterMetrics,
        tokenizer: Tokenizer | None = None,
    ) -> RouterRuntime:
        model_tokenizers: dict[str, Tokenizer] = {}
        if tokenizer is None:
            served = settings.served_models() if settings.tokenizer or settings.models else []
            model_tokenizers = {model.name: load_tokenizer(model.tokenizer) for model in served}
            first = next(iter(model_tokenizers.values()), None)
            tokenizer = first if first is not None else ByteTokenizer()
        pool = EnginePool(
            connectors,
            metrics,
            breaker=lambda: CircuitBreaker(
                backoff_s=settings.circuit_backoff_s,
                max_backoff_s=settings.circuit_max_backoff_s,
            ),
            holdover_s=settings.holdover_s,
        )
        feed: KVEventFeed | None = None
        if settings.kv_events and settings.policy == "prefix_aware":
            index = KVIndex(
                max_blocks_per_engine=settings.kv_index_blocks_per_engine,
                max_blocks_total=settings.kv_index_blocks_total,
                on_evicted=lambda bound: metrics.kv_index_evictions.labels(bound=bound).inc(),
                on_dropped=lambda reason: metrics.kv_events_dropped.labels(reason=reason).inc(),
                on_adopted=metrics.kv_parents_adopted.inc,
            )
            feed = KVEventFeed(
                index,
                metrics,
                replay_timeout_s=settings.kv_events_replay_timeout_s,
                heartbeat_s=settings.kv_events_heartbeat_s,
                silence_s=settings.kv_events_silence_s
                or 3 * settings.control_plane.heartbeat_interval_s,
            )
            pool.add_listener(feed)
        policy = make_policy(
            settings.policy,
            prefix_cache_blocks=settings.prefix_cache_blocks,
            prefix_load_slack=settings.prefix_load_slack,
            events=feed.index if feed is not None else None,
            prefill_cache_weight=settings.prefill_cache_weight,
            decode_cache_weight=settings.decode_cache_weight,
        )
        scheduler = Scheduler(pool, policy, settings, metrics)
        return cls(
            settings=settings,
            metrics=metrics,
            tokenizer=tokenizer,
            pool=pool,
            scheduler=scheduler,
            executor=Executor(
                pool,
                scheduler,
                settings,
                metrics,
                tokenizer=tokenizer,
                model_tokenizers=model_tokenizers,
            ),
            api_keys=tuple(key.get_secret_value().encode() for key in settings.api_keys),
            kv_events=feed,
        )

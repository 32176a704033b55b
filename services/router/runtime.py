"""The router's long-lived parts, built once per process (in the app's lifespan)."""

from __future__ import annotations

from dataclasses import dataclass

from services.router.config import RouterSettings
from services.router.execution.executor import Executor
from services.router.frontend.chat import ChatRenderer
from services.router.frontend.tokenizing import PromptTokenizer
from services.router.metrics import RouterMetrics
from services.router.scheduling.connector import ConnectorFactory
from services.router.scheduling.health import CircuitBreaker
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
    chat: ChatRenderer
    prompts: PromptTokenizer
    """Completion and chat prompts to token ids, long ones off the event loop."""
    pool: EnginePool
    scheduler: Scheduler
    executor: Executor
    api_keys: tuple[bytes, ...]

    @classmethod
    def build(
        cls,
        settings: RouterSettings,
        connectors: ConnectorFactory,
        metrics: RouterMetrics,
        tokenizer: Tokenizer | None = None,
    ) -> RouterRuntime:
        if tokenizer is None:
            tokenizer = (
                load_tokenizer(settings.tokenizer)
                if settings.tokenizer is not None
                else ByteTokenizer()
            )
        pool = EnginePool(
            connectors,
            metrics,
            breaker=lambda: CircuitBreaker(
                backoff_s=settings.circuit_backoff_s,
                max_backoff_s=settings.circuit_max_backoff_s,
            ),
        )
        policy = make_policy(
            settings.policy,
            prefix_cache_blocks=settings.prefix_cache_blocks,
            prefix_load_slack=settings.prefix_load_slack,
        )
        scheduler = Scheduler(pool, policy, settings, metrics)
        chat = ChatRenderer(tokenizer)
        return cls(
            settings=settings,
            metrics=metrics,
            tokenizer=tokenizer,
            chat=chat,
            prompts=PromptTokenizer(
                tokenizer, chat, workers=settings.tokenize_workers, queue=settings.tokenize_queue
            ),
            pool=pool,
            scheduler=scheduler,
            executor=Executor(pool, scheduler, settings, metrics, tokenizer=tokenizer),
            api_keys=tuple(key.get_secret_value().encode() for key in settings.api_keys),
        )

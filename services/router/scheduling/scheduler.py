"""Planning a request: local or disaggregated, and on which engines.

Pools (from :class:`~services.router.scheduling.pool.EnginePool`, READY engines of the request's
model):

- prefill engines: role ``prefill``;
- decode engines: roles ``decode`` and ``both`` (a ``both`` engine is a colocated engine: it
  serves requests locally and can also consume KV from a compatible prefill engine).

A disaggregated pair is a prefill and a decode engine with the same model, compatibility hash
and block size (:meth:`EngineSlot.compatible_with`). The plan is, in order:

1. no decode engine -> :class:`NoEngineAvailable` (503) naming why: no engine registered for
   the model (the front end only lets the configured model through, so never a 404), none
   READY, and how long the control plane has been unreachable if it is; with ``colocated``
   set, local on a decode engine, always;
2. no prefill engine compatible with any decode engine -> local on a ``both`` engine
   (colocated deployment, not a fallback); with only ``decode`` engines it is a fallback
   (``no_prefill_engine``, counted; ``prefill_circuit_open`` when compatible prefill engines
   exist but every one's circuit breaker is open) when ``local_fallback`` allows it, else 503;
3. a prompt of at most ``local_max_prompt_tokens`` -> local on a decode engine (conditional
   disaggregation: moving its KV costs more than computing it);
4. otherwise the policy picks a prefill engine among those with a compatible decode engine,
   then a compatible decode engine; if that decode engine likely holds at least
   ``local_cached_fraction`` of the prompt's blocks (by its KV events when it publishes them),
   the request runs there locally (conditional disaggregation from cache hits).

Every placement is counted in ``pdserve_router_placement_decisions_total{pool, reason}``
(``prefill`` / ``decode``: the policy's reason; ``local``: the plan's ``local_reason``), with
the prompt tokens the chosen engines hold (``pdserve_router_cached_tokens{pool}``) and the
blocks a disaggregated request's decode engine lacks (``pdserve_router_kv_blocks_moved``, and
in bytes, ``pdserve_router_kv_bytes_moved``, for engines whose record gives their block bytes).

A request naming a LoRA adapter (``PromptInfo.lora_name``) runs only on engines with LoRA
slots, and each stage prefers the engines that hold the adapter (:mod:`.adapters`); a
placement on an engine that must load it first is counted in
``pdserve_router_lora_loads_total``.

Health (``services.router.scheduling.health``): engines whose circuit breaker is open are not
chosen; a request that failed over or migrated also names engines to ``avoid``. When every decode
engine of the model has an open breaker (and none is avoided), they are chosen anyway: a decode
engine has no fallback, and refusing every request during a back-off after one failed call would
turn one error into many; except while the control plane is unreachable (nothing vouches for
them then: 503 naming the outage). Prefill engines have the local fallback instead.

Fallback counting happens here and in the executor (:mod:`services.router.execution.executor`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from services.control_plane.wire import EngineId, EngineRole
from services.router.config import RouterSettings
from services.router.errors import NoEngineAvailable
from services.router.metrics import RouterMetrics
from services.router.scheduling.adapters import lora_capable, prefer_holders
from services.router.scheduling.policies import PromptInfo, RoutingPolicy, Stage
from services.router.scheduling.pool import EnginePool, EngineSlot

PREFILL_ROLES = (EngineRole.PREFILL,)
DECODE_ROLES = (EngineRole.DECODE, EngineRole.BOTH)


@dataclass(frozen=True)
class Plan:
    """Where a request runs: ``prefill`` is ``None`` for local execution on ``decode``."""

    decode: EngineSlot
    prefill: EngineSlot | None
    local_reason: str | None = None
    """Why it runs locally: ``colocated``, ``short_prompt``, ``cached_prompt`` or a fallback
    reason (``no_prefill_engine``)."""


class Scheduler:
    """Builds a :class:`Plan` per request from the live pool; see the module docstring."""

    def __init__(
        self,
        pool: EnginePool,
        policy: RoutingPolicy,
        settings: RouterSettings,
        metrics: RouterMetrics,
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._settings = settings
        self._metrics = metrics

    def plan(
        self,
        model: str,
        prompt: PromptInfo,
        *,
        avoid_prefill: Collection[EngineId] = (),
        avoid_decode: Collection[EngineId] = (),
    ) -> Plan:
        """Choose engines for a request of ``model``, never one in ``avoid_*`` (engines this
        request already failed on); raises ``NoEngineAvailable``.
        Fallbacks decided here are counted here."""
        decodes = [
            s
            for s in self._pool.slots(DECODE_ROLES)
            if s.record.model == model and s.engine_id not in avoid_decode
        ]
        capable = lora_capable(decodes, prompt.lora_name)
        if decodes and not capable:
            raise self._unavailable(
                f"no READY decode engine of {model!r} serves LoRA adapters "
                f"(adapter {prompt.lora_name!r})"
            )
        decodes = capable
        if not decodes:
            registered = self._pool.registered_models()
            if model not in registered:
                others = f" (they serve {', '.join(sorted(registered))})" if registered else ""
                raise self._unavailable(
                    f"no engine registered in the control plane serves {model!r}{others}"
                )
            other = " other than " + ", ".join(sorted(avoid_decode)) if avoid_decode else ""
            raise self._unavailable(f"no READY decode engine{other} serves {model!r}")
        decodes = [s for s in decodes if prompt.fits(s.record.shape.max_model_len)]
        if not decodes:
            raise NoEngineAvailable(
                f"no READY decode engine of {model!r} holds {prompt.context_tokens} tokens"
            )
        answering = [s for s in decodes if s.health.available()]
        if not answering and self._pool.control_plane_unreachable_s() > 0:
            # Chosen anyway below when Redis vouches for them; during an outage nothing does.
            raise self._unavailable(
                f"no decode engine of {model!r} answers (the last call on each failed)"
            )
        decodes = answering or decodes
        if self._settings.colocated:
            return self._local(decodes, prompt, "colocated")
        prefills = [
            s
            for s in self._pool.slots(PREFILL_ROLES)
            if s.record.model == model
            and s.engine_id not in avoid_prefill
            and prompt.fits(s.record.shape.max_model_len)
        ]
        prefills = lora_capable(prefills, prompt.lora_name)
        paired = [p for p in prefills if any(p.compatible_with(d) for d in decodes)]
        healthy = [p for p in paired if p.health.available()]
        if not healthy:
            colocated = [s for s in decodes if s.role is EngineRole.BOTH]
            if colocated:
                return self._local(colocated, prompt, "colocated")
            if not self._settings.local_fallback:
                raise self._unavailable(
                    f"no READY prefill engine compatible with a decode engine of {model!r}"
                    + (" whose circuit is closed" if paired else "")
                )
            if paired:
                reason = "prefill_circuit_open"
            elif avoid_prefill and any(
                s.record.model == model for s in self._pool.slots(PREFILL_ROLES)
            ):
                # Every prefill engine left was one whose KV this request could not get.
                reason = "kv_handoff_failed"
            else:
                reason = "no_prefill_engine"
            self._metrics.fallbacks.labels(reason=reason).inc()
            return self._local(decodes, prompt, reason)
        paired = healthy
        if len(prompt.token_ids) <= self._settings.local_max_prompt_tokens:
            return self._local(decodes, prompt, "short_prompt")
        prefill, prefill_loads = self._choose(paired, prompt, Stage.PREFILL)
        prefill_reason = self._policy.reason
        partners = [d for d in decodes if d.compatible_with(prefill)]
        decode, decode_loads = self._choose(partners, prompt, Stage.DECODE)
        decode_reason = self._policy.reason
        # Hashing the prompt is only needed when the policy knows of cached blocks (never for
        # round_robin / least_loaded); local_cached_fraction > 0, so 0 cached never qualifies.
        cached = self._policy.cached_blocks(decode, prompt)
        block_size = decode.record.shape.block_size
        if cached and cached >= self._settings.local_cached_fraction * prompt.full_blocks(
            block_size
        ):
            self._policy.routed(decode, prompt)
            self._count("local", "cached_prompt", cached * block_size)
            self._count_load("local", decode_loads)
            return Plan(decode=decode, prefill=None, local_reason="cached_prompt")
        self._count(
            "prefill",
            prefill_reason,
            self._policy.cached_blocks(prefill, prompt) * prefill.record.shape.block_size,
        )
        self._count("decode", decode_reason, cached * block_size)
        self._count_load("prefill", prefill_loads)
        self._count_load("decode", decode_loads)
        blocks = -(-len(prompt.token_ids) // block_size)
        self._metrics.kv_blocks_moved.observe(blocks - cached)
        if decode.record.kv_block_bytes:
            self._metrics.kv_bytes_moved.observe((blocks - cached) * decode.record.kv_block_bytes)
        self._policy.routed(prefill, prompt)
        self._policy.routed(decode, prompt)
        return Plan(decode=decode, prefill=prefill)

    def _unavailable(self, message: str) -> NoEngineAvailable:
        """A 503 for ``message``, naming the control-plane outage when there is one (the pool
        then is the view from before it)."""
        outage_s = self._pool.control_plane_unreachable_s()
        if outage_s > 0:
            message += f" (the control plane has been unreachable for {outage_s:.0f} s)"
        return NoEngineAvailable(message)

    def _choose(
        self, candidates: list[EngineSlot], prompt: PromptInfo, stage: Stage
    ) -> tuple[EngineSlot, bool]:
        """The policy's choice among ``candidates``, those holding the request's LoRA adapter
        when any does (:mod:`.adapters`), and whether the chosen engine loads it first."""
        preferred, loads = prefer_holders(candidates, prompt.lora_name)
        return self._policy.choose(preferred, prompt, stage), loads

    def _count_load(self, pool: str, loads: bool) -> None:
        """Count the adapter load a placement on an engine without it causes."""
        if loads:
            self._metrics.lora_loads.labels(pool=pool, outcome="ok").inc()

    def _count(self, pool: str, reason: str, cached_tokens: int) -> None:
        self._metrics.placement_by(pool, reason).inc()
        self._metrics.cached_tokens_by(pool).observe(cached_tokens)

    def next_prefill(
        self, decode: EngineSlot, prompt: PromptInfo, tried: Collection[EngineId]
    ) -> EngineSlot | None:
        """Another prefill engine compatible with ``decode`` for a retry, or ``None``."""
        candidates = [
            s
            for s in self._pool.slots(PREFILL_ROLES)
            if s.engine_id not in tried
            and s.compatible_with(decode)
            and prompt.fits(s.record.shape.max_model_len)
            and s.health.available()
        ]
        candidates = lora_capable(candidates, prompt.lora_name)
        if not candidates:
            return None
        chosen, loads = self._choose(candidates, prompt, Stage.PREFILL)
        self._metrics.placement_by("prefill", self._policy.reason).inc()
        self._count_load("prefill", loads)
        self._policy.routed(chosen, prompt)
        return chosen

    def ready(self) -> bool:
        """Whether the router can serve: a READY compatible prefill/decode pair, or a READY
        ``both`` engine, or (``colocated`` set) any READY decode engine. Otherwise a lone
        ``decode`` engine is not enough: serving through it would be the
        ``no_prefill_engine`` fallback, and readiness must not hide a missing side of the
        pair."""
        decodes = self._pool.slots(DECODE_ROLES)
        if decodes and self._settings.colocated:
            return True
        if any(s.role is EngineRole.BOTH for s in decodes):
            return True
        prefills = self._pool.slots(PREFILL_ROLES)
        return any(p.compatible_with(d) for p in prefills for d in decodes)

    def _local(self, candidates: list[EngineSlot], prompt: PromptInfo, reason: str) -> Plan:
        decode, loads = self._choose(candidates, prompt, Stage.LOCAL)
        self._count(
            "local",
            reason,
            self._policy.cached_blocks(decode, prompt) * decode.record.shape.block_size,
        )
        self._count_load("local", loads)
        self._policy.routed(decode, prompt)
        return Plan(decode=decode, prefill=None, local_reason=reason)

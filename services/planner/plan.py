"""One interval of planning, without I/O: a snapshot of the router's figures in, a decision per
pool out (the loop in :mod:`services.planner.main` fetches, publishes and prints)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.engines.sim.profile import SimProfile
from services.planner.decision import Bounds, Decision, PoolPlanner
from services.planner.observe import Interval, PoolLoad, RouterSnapshot, interval_between
from services.planner.predictors import LoadPredictor
from services.planner.pressure import Pressure, allowed_queue, kv_pressure_need, queue_need
from services.planner.sizing import (
    Load,
    PoolSize,
    Slo,
    correction,
    decode_size,
    expected_itl_ms,
    expected_ttft_ms,
    prefill_service_ms,
    prefill_size,
)


@dataclass(frozen=True)
class PoolPlan:
    """One pool's outcome of an interval."""

    decision: Decision
    correction: float
    size: PoolSize | None
    """``None`` when the interval had no figures."""
    slo_breach: bool = False
    """The interval's observed mean missed the SLO while the profile said the pool was big
    enough: the need was raised to one engine more than the pool has (:func:`breach_need`)."""
    load: PoolLoad | None = None
    """The pool's engines' load at the read (``None``: not relayed by the router)."""
    pressure: Pressure | None = None
    """The engines' load was past its rule's limit: the need is at least one engine more than
    the pool has (:mod:`services.planner.pressure`)."""


LengthsSource = Literal["router", "flags"]


@dataclass(frozen=True)
class PlanStep:
    interval: Interval | None
    predicted: Load | None
    prefill: PoolPlan
    decode: PoolPlan
    lengths: LengthsSource | None = None
    """Where the interval's mean input and output lengths came from: the router's token
    figures (this interval's, or the last interval that had any), or the settings (a router
    that counts no tokens, or none yet); ``None`` for an interval without figures."""


class Planner:
    """Sizes both pools each interval from ``profile`` at ``slo``. The mean lengths are the
    router's (its token histograms over the interval); ``input_tokens`` and ``output_tokens``
    stand in for each until the router has measured it (a router without the histograms, or
    no request finished yet), and an interval where no request finished keeps the last
    measured."""

    def __init__(
        self,
        profile: SimProfile,
        slo: Slo,
        predictor: LoadPredictor,
        *,
        prefill: Bounds,
        decode: Bounds,
        window: int,
        input_tokens: float,
        output_tokens: float,
        correction_range: tuple[float, float] = (0.5, 3.0),
        kv_usage_limit: float = 0.9,
        prefill_queue_limit: float | None = None,
        cached_tokens: bool = True,
    ) -> None:
        """``kv_usage_limit``: the decode pool's KV usage above which it needs one engine more;
        ``prefill_queue_limit``: the requests waiting per prefill engine above which that pool
        does (``None``: what the TTFT SLO allows, :func:`pressure.allowed_queue`);
        ``cached_tokens``: whether the router's cached-token count shortens a prefill (off:
        every prompt token is computed, for comparison)."""
        self.profile = profile
        self.slo = slo
        self.predictor = predictor
        self.prefill = PoolPlanner(prefill, window)
        self.decode = PoolPlanner(decode, window)
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.correction_range = correction_range
        self.kv_usage_limit = kv_usage_limit
        self.prefill_queue_limit = prefill_queue_limit
        self.cached_tokens = cached_tokens
        self._last: RouterSnapshot | None = None
        self._breaches = {"prefill": BreachMemory(), "decode": BreachMemory()}
        self._measured_input: float | None = None
        self._measured_output: float | None = None
        self._measured_cached = 0.0

    def step(self, snapshot: RouterSnapshot | None) -> PlanStep:
        """The decisions after an interval ending at ``snapshot`` (``None``: its figures could
        not be read, so both pools hold)."""
        if snapshot is None:
            return self._hold()
        before, self._last = self._last, snapshot
        if before is None:
            # The first read: the pools start from what the router has now.
            for pool, ready in (
                (self.prefill, snapshot.ready_prefill),
                (self.decode, snapshot.ready_decode),
            ):
                if ready:
                    pool.desired = pool.bounds.clamp(ready)
            return self._hold()
        interval = interval_between(before, snapshot)
        if interval is None:
            return self._hold()
        if interval.input_tokens is not None:
            self._measured_input = interval.input_tokens
        if interval.output_tokens is not None:
            self._measured_output = interval.output_tokens
        if interval.cached_tokens is not None and self.cached_tokens:
            self._measured_cached = interval.cached_tokens
        measured = self._measured_input is not None and self._measured_output is not None
        observed = Load(
            interval.rate_rps,
            self._measured_input if self._measured_input is not None else self.input_tokens,
            self._measured_output if self._measured_output is not None else self.output_tokens,
            self._measured_cached,
        )
        self.predictor.observe(observed)
        predicted = self.predictor.predict() or observed
        low, high = self.correction_range
        prefill_engines = snapshot.ready_prefill or self.prefill.desired
        decode_engines = snapshot.ready_decode or self.decode.desired
        service_s = (
            prefill_service_ms(self.profile, observed.input_tokens, observed.cached_tokens) / 1000
        )
        utilisation = observed.rate_rps * service_s / prefill_engines
        prefill_ratio = correction(
            interval.ttft_ms,
            expected_ttft_ms(
                self.profile, observed.input_tokens, utilisation, observed.cached_tokens
            ),
            low,
            high,
        )
        decode_ratio = correction(
            interval.itl_ms, expected_itl_ms(self.profile, observed, decode_engines), low, high
        )
        prefill = prefill_size(self.profile, predicted, self.slo.ttft_ms / prefill_ratio)
        decode = decode_size(self.profile, predicted, self.slo.itl_ms / decode_ratio)
        prefill_load = snapshot.pool_load("prefill")
        decode_load = snapshot.pool_load("decode")
        queue_limit = self.prefill_queue_limit
        if queue_limit is None:
            queue_limit = allowed_queue(self.profile, observed.input_tokens, self.slo.ttft_ms)
        queued = queue_need(prefill_load, snapshot.ready_prefill, queue_limit)
        kv_full = kv_pressure_need(decode_load, snapshot.ready_decode, self.kv_usage_limit)
        prefill_need, prefill_breach = self._checked(
            "prefill", prefill.replicas, interval, interval.ttft_ms, self.slo.ttft_ms,
            snapshot.ready_prefill, predicted.rate_rps, queued,
        )  # fmt: skip
        decode_need, decode_breach = self._checked(
            "decode", decode.replicas, interval, interval.itl_ms, self.slo.itl_ms,
            snapshot.ready_decode, predicted.rate_rps, kv_full,
        )  # fmt: skip
        return PlanStep(
            interval,
            predicted,
            PoolPlan(
                self.prefill.decide(prefill_need), prefill_ratio, prefill, prefill_breach,
                prefill_load, None if queued is None else "queue",
            ),
            PoolPlan(
                self.decode.decide(decode_need), decode_ratio, decode, decode_breach,
                decode_load, None if kv_full is None else "kv_pressure",
            ),
            "router" if measured else "flags",
        )  # fmt: skip

    def _checked(
        self,
        pool: str,
        sized: int,
        interval: Interval,
        observed_ms: float | None,
        slo_ms: float,
        ready: int | None,
        predicted_rps: float,
        pressure_need: int | None,
    ) -> tuple[int, bool]:
        """``sized`` after the SLO check (:func:`breach_need`), the engines' load
        (``pressure_need``: a floor, :mod:`services.planner.pressure`) and the pool's memory
        of the sizes that missed the SLO (:class:`BreachMemory`)."""
        memory = self._breaches[pool]
        memory.tick()
        need, breach = breach_need(sized, observed_ms, slo_ms, ready)
        if breach and ready is not None:
            memory.record(ready, interval.rate_rps)
        if pressure_need is not None:
            need = max(need, pressure_need)
        return memory.floor(need, predicted_rps), breach

    def _hold(self) -> PlanStep:
        return PlanStep(
            None,
            None,
            PoolPlan(self.prefill.hold(), 1.0, None),
            PoolPlan(self.decode.hold(), 1.0, None),
        )


def breach_need(
    sized: int, observed_ms: float | None, slo_ms: float, ready: int | None
) -> tuple[int, bool]:
    """The need after the SLO check: a pool whose interval missed its SLO (observed mean above
    it) although the profile sized it big enough (``sized <= ready``) needs one engine more
    than it has. The profile's correction is bounded (``--correction-max``), and latency the
    profile does not model (a busy host, a slow network) would otherwise never be answered.
    Scale-down stabilization still bounds how soon it goes back."""
    if observed_ms is None or ready is None or observed_ms <= slo_ms or sized > ready:
        return sized, False
    return ready + 1, True


class BreachMemory:
    """One pool's sizes that missed the SLO, each with the lowest rate it missed at. Going
    down, a size is skipped while the predicted rate is at least ``margin`` of that rate: the
    profile said the size was enough once and it was not, so it is not trusted again at that
    load (without this the pool goes down, misses, comes back up, once a stabilization
    window). A memory is forgotten after ``keep_intervals`` intervals (the host or network
    that slowed the pool may have recovered)."""

    def __init__(self, margin: float = 0.8, keep_intervals: int = 60) -> None:
        self.margin = margin
        self.keep_intervals = keep_intervals
        self._missed: dict[int, tuple[float, int]] = {}
        """size -> (lowest rate it missed at, intervals since)."""

    def tick(self) -> None:
        self._missed = {
            size: (rate, age + 1)
            for size, (rate, age) in self._missed.items()
            if age + 1 < self.keep_intervals
        }

    def record(self, size: int, rate_rps: float) -> None:
        known = self._missed.get(size)
        self._missed[size] = (min(rate_rps, known[0]) if known else rate_rps, 0)

    def floor(self, need: int, rate_rps: float) -> int:
        """The smallest size from ``need`` up that did not miss at this rate."""
        while need in self._missed and rate_rps >= self.margin * self._missed[need][0]:
            need += 1
        return need


def step_record(step: PlanStep) -> dict[str, object]:
    """The JSON line of one interval (what ``pdserve planner`` prints)."""
    record: dict[str, object] = {}
    if step.interval is not None:
        record["observed"] = {
            "interval_s": round(step.interval.duration_s, 3),
            "rate_rps": round(step.interval.rate_rps, 4),
            "ttft_ms": _round(step.interval.ttft_ms),
            "itl_ms": _round(step.interval.itl_ms),
        }
    if step.predicted is not None:
        record["predicted"] = {
            "rate_rps": round(step.predicted.rate_rps, 4),
            "input_tokens": round(step.predicted.input_tokens, 1),
            "output_tokens": round(step.predicted.output_tokens, 1),
            "cached_tokens": round(step.predicted.cached_tokens, 1),
            "lengths": step.lengths,
        }
    for name, plan in (("prefill", step.prefill), ("decode", step.decode)):
        pool: dict[str, object] = {
            "desired": plan.decision.desired,
            "needed": plan.decision.needed,
            "reason": plan.decision.reason,
            "correction": round(plan.correction, 3),
        }
        if plan.size is not None:
            pool["tokens_per_s_per_engine"] = round(plan.size.tokens_per_s, 1)
            pool["slo_reachable"] = plan.size.slo_reachable
        if plan.slo_breach:
            pool["slo_breach"] = True
        if plan.load is not None:
            pool["queue_depth"] = round(plan.load.queue_depth)
            pool["running_requests"] = round(plan.load.running_requests)
            pool["kv_usage"] = _round(plan.load.kv_usage)
        if plan.pressure is not None:
            pool["pressure"] = plan.pressure
        record[name] = pool
    return record


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)

"""The planner's sizing arithmetic: hand-computed pools on a profile of round figures, and
monotone on the shipped one (a higher rate or a tighter SLO never gives fewer replicas)."""

from __future__ import annotations

import itertools

import pytest

from services.engines.sim.profile import SimProfile, load_profile, parse_profile
from services.planner.sizing import (
    RHO_CAP,
    Load,
    correction,
    decode_size,
    expected_itl_ms,
    expected_ttft_ms,
    max_decode_batch,
    prefill_service_ms,
    prefill_size,
)


def _profile(num_blocks: int = 30000) -> SimProfile:
    """A prompt of 1000 tokens takes 20 ms; a decode step 5 + 0.125 ms a sequence."""
    return parse_profile(
        {
            "format_version": 1,
            "name": "round",
            "source": {"url": "test", "figures": "round numbers"},
            "model": {
                "name": "m",
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_size": 8,
                "vocab_size": 256,
                "max_model_len": 8192,
            },
            "prefill": {"base_ms": 10, "per_token_ms": 0.01, "per_token_squared_ms": 0},
            "decode": {"base_ms": 5, "per_sequence_ms": 0.125, "per_context_token_ms": 0},
            "kv_cache": {"num_blocks": num_blocks, "block_size": 16},
            "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 256},
        }
    )


LOAD = Load(rate_rps=100, input_tokens=1000, output_tokens=200)


def test_prefill_pool_meets_the_ttft_at_the_md1_utilisation() -> None:
    # s = 20 ms, so 50 prompts/s an engine; ttft 50 ms: k = 50/20 - 1 = 1.5, rho = 3/4;
    # 100 requests/s need ceil(100 / (0.75 * 50)) = 3 engines.
    size = prefill_size(_profile(), LOAD, ttft_ms=50)
    assert size.replicas == 3
    assert size.tokens_per_s == pytest.approx(50_000)
    assert size.slo_reachable
    # At that utilisation the model's TTFT is the SLO itself.
    assert expected_ttft_ms(_profile(), 1000, 0.75) == pytest.approx(50)


def test_prefill_utilisation_is_capped_and_floored() -> None:
    profile = _profile()
    # A loose SLO: rho would be 98/99, capped at 0.9: ceil(100 / 45) = 3.
    assert prefill_size(profile, LOAD, ttft_ms=1000).replicas == 3
    # The prefill alone is the whole budget (k = 0): the floor, 0.1: ceil(100 / 5) = 20.
    assert prefill_size(profile, LOAD, ttft_ms=20).replicas == 20
    unreachable = prefill_size(profile, LOAD, ttft_ms=10)
    assert (unreachable.replicas, unreachable.slo_reachable) == (20, False)
    assert expected_ttft_ms(profile, 1000, 2.0) == expected_ttft_ms(profile, 1000, RHO_CAP)


def test_decode_pool_from_the_largest_batch_meeting_the_itl() -> None:
    # ITL 17.5 ms: 5 + 0.125 B <= 17.5 gives B = 100, 100 * 1000 / 17.5 tokens/s an engine;
    # 100 requests/s x 200 tokens = 20,000 tokens/s need ceil(3.5) = 4 engines.
    assert max_decode_batch(_profile(), LOAD, itl_ms=17.5) == (100, True)
    size = decode_size(_profile(), LOAD, itl_ms=17.5)
    assert size.tokens_per_s == pytest.approx(100_000 / 17.5)
    assert size.replicas == 4


def test_decode_batch_is_bounded_by_kv_blocks_and_max_num_seqs() -> None:
    # 1200 tokens a sequence = 75 blocks; 3000 blocks hold 40 sequences: step 10 ms,
    # 4000 tokens/s, 5 engines.
    small = _profile(num_blocks=3000)
    assert max_decode_batch(small, LOAD, itl_ms=17.5) == (40, True)
    assert decode_size(small, LOAD, itl_ms=17.5).replicas == 5
    assert max_decode_batch(_profile(), LOAD, itl_ms=1000)[0] == 256


def test_an_itl_below_one_step_sizes_for_batches_of_one() -> None:
    batch, reachable = max_decode_batch(_profile(), LOAD, itl_ms=4)
    assert (batch, reachable) == (1, False)
    # One sequence, 5.125 ms a token: 195 tokens/s; 20,000 tokens/s need 103 engines.
    assert decode_size(_profile(), LOAD, itl_ms=4).replicas == 103


def test_no_load_needs_no_engines() -> None:
    idle = Load(0, 1000, 200)
    assert prefill_size(_profile(), idle, 50).replicas == 0
    assert decode_size(_profile(), idle, 17.5).replicas == 0


RATES = (0.5, 2, 8, 20, 60, 150)
TTFTS = (5, 20, 40, 80, 200, 1000)
ITLS = (3, 5, 6, 8, 12, 25, 60)
LENGTHS = ((128, 32), (1024, 256), (4000, 1000))


@pytest.mark.parametrize(("input_tokens", "output_tokens"), LENGTHS)
def test_a_higher_rate_never_needs_fewer_replicas(input_tokens: int, output_tokens: int) -> None:
    profile = load_profile()
    for ttft, itl in itertools.product(TTFTS, ITLS):
        prefill = [
            prefill_size(profile, Load(r, input_tokens, output_tokens), ttft).replicas
            for r in RATES
        ]
        decode = [
            decode_size(profile, Load(r, input_tokens, output_tokens), itl).replicas for r in RATES
        ]
        assert prefill == sorted(prefill), (ttft, prefill)
        assert decode == sorted(decode), (itl, decode)


@pytest.mark.parametrize(("input_tokens", "output_tokens"), LENGTHS)
def test_a_tighter_slo_never_needs_fewer_replicas(input_tokens: int, output_tokens: int) -> None:
    profile = load_profile()
    for rate in RATES:
        load = Load(rate, input_tokens, output_tokens)
        # SLOs loosest first: the needs may only grow as they tighten.
        prefill = [prefill_size(profile, load, t).replicas for t in reversed(TTFTS)]
        decode = [decode_size(profile, load, i).replicas for i in reversed(ITLS)]
        assert prefill == sorted(prefill), (rate, prefill)
        assert decode == sorted(decode), (rate, decode)
    # At the highest rate the SLOs really move the needs.
    assert prefill[-1] > prefill[0]
    assert decode[-1] > decode[0]


def test_expected_itl_grows_with_load_and_shrinks_with_engines() -> None:
    profile = _profile()
    light = expected_itl_ms(profile, Load(1, 1000, 200), engines=1)
    heavy = expected_itl_ms(profile, Load(20, 1000, 200), engines=1)
    spread = expected_itl_ms(profile, Load(20, 1000, 200), engines=4)
    assert light < heavy
    assert spread < heavy
    assert light >= profile.decode_step_ms(1, 0)
    # Past what one engine can serve the batch is the most it runs.
    assert expected_itl_ms(profile, Load(1000, 1000, 200), 1) == pytest.approx(5 + 0.125 * 256)


def test_correction_is_the_clamped_ratio() -> None:
    assert correction(None, 10, 0.5, 3) == 1.0
    assert correction(15, 10, 0.5, 3) == pytest.approx(1.5)
    assert correction(100, 10, 0.5, 3) == 3
    assert correction(1, 10, 0.5, 3) == 0.5


def test_a_load_whose_prompts_mostly_hit_the_cache_needs_fewer_prefill_engines() -> None:
    """The planner reads the cached tokens the router reports (``Load.cached_tokens``): a
    prompt of 1000 tokens with 900 cached takes 11 ms, not 20, and the pool shrinks to match;
    the model's TTFT follows."""
    profile = _profile()
    cached = Load(rate_rps=100, input_tokens=1000, output_tokens=200, cached_tokens=900)
    assert prefill_service_ms(profile, 1000, 900) == pytest.approx(11)
    assert prefill_service_ms(profile, 1000, 5000) == pytest.approx(10.01)  # the last token
    assert (
        prefill_size(profile, cached, ttft_ms=50).replicas
        < prefill_size(profile, LOAD, ttft_ms=50).replicas
    )
    assert expected_ttft_ms(profile, 1000, 0.5, cached_tokens=900) < expected_ttft_ms(
        profile, 1000, 0.5
    )

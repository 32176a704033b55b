"""``pdserve bench router --vllm-api-server``'s side-by-side columns: pdserve's router and vLLM's
own API server over the same tokenizer, each one's CPU per request and its ratio to pdserve's."""

from __future__ import annotations

from typing import Any

from services.bench.router_frontends import COLUMNS, frontend_comparison


def result(cpu: float, chat_cpu: float | None, rps: float, per_token: float) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "router_cpu_ms_per_request": cpu,
        "max_sustained_rps": rps,
        "streamed": {"router_cpu_ms_per_extra_token": per_token},
    }
    if chat_cpu is not None:
        figures["chat"] = {"router_cpu_ms_per_request": chat_cpu}
    return figures


def test_each_front_end_beside_pdserves_router_and_its_ratio() -> None:
    compared = frontend_comparison(
        {
            "pdserve": result(2.0, 3.0, 500.0, 0.1),
            "vllm_api_server": result(1.0, 1.5, 300.0, 0.05),
        }
    )
    assert set(compared["router_cpu_ms_per_request"]) == set(COLUMNS)
    assert compared["router_cpu_ms_per_request"] == {"pdserve": 2.0, "vllm_api_server": 1.0}
    assert compared["router_cpu_ratio"] == {"vllm_api_server": 0.5}
    assert compared["chat_router_cpu_ratio"] == {"vllm_api_server": 0.5}
    assert compared["max_sustained_rps"] == {"pdserve": 500.0, "vllm_api_server": 300.0}
    assert compared["router_cpu_ms_per_extra_token"]["vllm_api_server"] == 0.05


def test_a_missing_figure_has_no_ratio() -> None:
    compared = frontend_comparison(
        {"pdserve": result(2.0, None, 1.0, 0.1), "vllm_api_server": result(1.0, 1.5, 1.0, 0.1)}
    )
    assert compared["chat_router_cpu_ms_per_request"]["pdserve"] is None
    assert compared["chat_router_cpu_ratio"] == {"vllm_api_server": None}

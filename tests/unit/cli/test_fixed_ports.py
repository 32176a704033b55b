"""Which ports ``pdserve up`` checks before it starts anything (``up.fixed_ports``)."""

from __future__ import annotations

from services.cli.main import build_parser
from services.cli.up import fixed_ports


def ports_of(*argv: str) -> list[tuple[str, str, int]]:
    return fixed_ports(build_parser().parse_args(["up", *argv]))


def test_the_router_port_and_a_fixed_redis_port_are_checked() -> None:
    assert ports_of() == [("router", "127.0.0.1", 8000)]
    assert ports_of("--port", "0", "--redis-port", "7000", "--host", "::1") == [
        ("router", "::1", 0),
        ("embedded Redis", "127.0.0.1", 7000),
    ]


def test_an_external_redis_and_no_engines_bind_nothing_of_theirs() -> None:
    assert ports_of("--redis", "redis://elsewhere:6379/0", "--redis-port", "7000") == [
        ("router", "127.0.0.1", 8000)
    ]
    assert ports_of("--no-engines") == []


def test_each_router_workers_metrics_port_is_checked() -> None:
    checked = ports_of("--router-workers", "2", "--router-arg=--worker-metrics-port=9100")
    assert [port for _, _, port in checked] == [8000, 9100, 9101]
    spaced = ports_of("--router-arg=--worker-metrics-port", "--router-arg=9200")
    assert [port for _, _, port in spaced] == [8000, 9200]

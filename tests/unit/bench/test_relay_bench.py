"""``pdserve bench relay``: a real grpc.aio server process paced by a step ticker, every case's
tokens received, the server's CPU read from its process."""

from __future__ import annotations

import argparse

from services.bench import relay


def test_every_case_streams_its_tokens_and_the_server_cpu_is_read() -> None:
    parser = argparse.ArgumentParser()
    relay.add_arguments(parser)
    args = parser.parse_args(
        ["--step-ms", "1", "--tokens", "20", "--rounds", "2", "--streams", "1,3"]
    )
    result = relay.run(args)
    cases = [
        (case["streams"], case["messages_per_step"], case["tokens"]) for case in result["cases"]
    ]
    # One stream; three as three calls (a message per token and stream); three as one call.
    assert cases == [(1, 1, 40), (3, 3, 120), (3, 1, 120)]
    assert all(case["server_cpu_ms_per_token"] >= 0 for case in result["cases"])
    # The server's clock moved (a reading of 0 everywhere would mean the wrong process).
    assert sum(case["server_cpu_ms_per_token"] for case in result["cases"]) > 0

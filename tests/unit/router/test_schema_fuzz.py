"""Schema fuzzing of the router's OpenAPI spec (schemathesis): no input yields a 5xx.

In-process (ASGI) over fake engines, so the examples cost milliseconds; every generated
request must get a non-5xx answer, and every error answer must be the OpenAI envelope.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from services.control_plane.wire import EngineRole
from services.router.main import create_app
from tests.unit.router.fakes import FakeFactory, runtime, view


def _app():  # type: ignore[no-untyped-def]
    rt = runtime(FakeFactory())
    for engine_id, role in (("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE)):
        rt.pool.update(engine_id, view(engine_id, role))
    rt.pool._synced.set()
    return create_app(rt.settings, runtime=rt)


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_generated_request_gets_a_server_error(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}

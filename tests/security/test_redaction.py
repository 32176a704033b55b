"""Redis URLs are printed with their password masked (``pdserve up``, settings errors)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config import RedisSettings
from services.config.control_plane import redact_url, split_url_password
from services.router.config import RouterSettings


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("rediss://ops:hunter2@redis.internal:6380/1", "rediss://ops:***@redis.internal:6380/1"),
        ("redis://ops@127.0.0.1/0", "redis://ops@127.0.0.1/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("redis://:hunter2@[::1:6379", "<unparseable url>"),
        (
            "rediss://redis.internal:6380/0?password=hunter2",
            "rediss://redis.internal:6380/0?password=***",
        ),
        (
            "unix:///run/redis.sock?db=2&password=hunter2",
            "unix:///run/redis.sock?db=2&password=***",
        ),
    ],
)
def test_redis_urls_are_shown_without_their_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "without", "password"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", None),
        ("redis://:hunter2@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0", "hunter2"),
        (
            "rediss://ops:hunter2@r.internal:6380/1?ssl_cert_reqs=none",
            "rediss://ops@r.internal:6380/1?ssl_cert_reqs=none",
            "hunter2",
        ),
        ("unix:///run/redis.sock?db=2&password=hunter2", "unix:///run/redis.sock?db=2", "hunter2"),
    ],
)
def test_a_url_password_is_split_off_for_child_processes(
    url: str, without: str, password: str | None
) -> None:
    assert split_url_password(url) == (without, password)
    assert RedisSettings(url=without).url == without  # still a valid setting


def test_settings_errors_and_reprs_do_not_show_the_password() -> None:
    with pytest.raises(ValidationError) as caught:
        RedisSettings(url="http://:hunter2@127.0.0.1:6379/0")
    assert "redis url must start with" in str(caught.value)
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ValidationError) as caught:
        RedisSettings(url="redis://:hunter2@[::1:6379")
    assert "not a valid URL" in str(caught.value)
    assert "hunter2" not in str(caught.value)
    settings = RedisSettings(url="redis://:hunter2@127.0.0.1:6379/0", password="pw-2")  # type: ignore[arg-type]
    assert settings.display_url == "redis://:***@127.0.0.1:6379/0"
    assert "pw-2" not in repr(settings)


def test_router_settings_errors_do_not_echo_api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # A key given as a JSON string instead of a list: refused without being echoed.
    monkeypatch.setenv("PDSERVE_ROUTER_API_KEYS", '"sk-not-a-list-77"')
    with pytest.raises(ValidationError) as caught:
        RouterSettings()
    assert "api_keys" in str(caught.value)
    assert "sk-not-a-list-77" not in str(caught.value)

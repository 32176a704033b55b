"""Fixtures of the security tests: certificates (openssl) shared by the module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.pki import make_pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CA, server (127.0.0.1) and client certificates; see :func:`make_pki`."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unrelated CA and certificates: trusted by nobody else in the tests."""
    return make_pki(tmp_path_factory.mktemp("other-pki"))

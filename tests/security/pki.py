"""Throw-away certificates for the security tests, made with the ``openssl`` command line.

:func:`make_pki` writes, under one folder, a CA (``ca.pem``/``ca.key``), a server certificate
for ``127.0.0.1``/``localhost`` (``server.pem``/``server.key``) and a client certificate
(``client.pem``/``client.key``), both signed by the CA. A second call with another folder gives
an unrelated CA, for "wrong CA" tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=pdserve-test-ca", "-keyout", "ca.key", "-out", "ca.pem",
        cwd=root,
    )  # fmt: skip
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr",
            cwd=root,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem",
            cwd=root,
        )  # fmt: skip
    return root

"""Install Prometheus and ``promtool`` for the tests, without root (``make test`` runs this).

``python -m services.devtools.install_prometheus DEST`` does nothing when a ``prometheus`` and a
``promtool`` are on ``PATH`` or already under ``DEST``; otherwise it fetches Debian's
``prometheus`` package with ``apt-get download`` (no root needed: it only writes the ``.deb``
into a temporary folder), unpacks it with ``dpkg -x`` and keeps the two static binaries as
``DEST/bin/prometheus`` and ``DEST/bin/promtool``. Best effort, it also unpacks the web UI's
templates and the JavaScript packages they link to (``libjs-*``) into ``DEST/web``, which
:class:`~services.observability.local_prometheus.LocalPrometheus` passes as
``--web.local-assets`` (the HTTP API works without them; the UI pages do not).

Where the package cannot be fetched (no ``apt-get``, no Debian mirror) it prints why and how to
install Prometheus by hand and exits 0: ``make test`` goes on, and the tests that need Prometheus
fail with that message (:func:`services.observability.local_prometheus.find_binary`). ``--strict``
makes it exit 1 instead.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "prometheus"
BINARIES = ("prometheus", "promtool")
UI_PACKAGES = (
    "fonts-glyphicons-halflings",
    "libjs-bootstrap4",
    "libjs-d3",
    "libjs-eonasdan-bootstrap-datetimepicker",
    "libjs-jquery",
    "libjs-jquery-hotkeys",
    "libjs-moment",
    "libjs-moment-timezone",
    "libjs-mustache",
    "libjs-popper.js",
    "libjs-rickshaw",
)
"""What the package's ``usr/share/prometheus/web/static`` links to (its ``Depends``)."""


class InstallFailed(Exception):
    """The package could not be fetched or unpacked; the message says which step failed."""


def installed(dest: Path) -> bool:
    return all((dest / "bin" / name).is_file() for name in BINARIES)


def on_path() -> bool:
    return all(shutil.which(name) is not None for name in BINARIES)


def install(dest: Path) -> None:
    """Fetch and unpack Debian's package into ``dest/bin``; :class:`InstallFailed` on failure."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise InstallFailed(f"no {tool} on PATH (not a Debian-family system)")
    with tempfile.TemporaryDirectory(prefix="pdserve-prometheus-") as scratch:
        folder = Path(scratch)
        _run(["apt-get", "download", PACKAGE], folder)
        debs = sorted(folder.glob(f"{PACKAGE}_*.deb"))
        if not debs:
            raise InstallFailed(f"apt-get download {PACKAGE} left no .deb in {folder}")
        unpacked = folder / "root"
        _run(["dpkg", "-x", str(debs[-1]), str(unpacked)], folder)
        (dest / "bin").mkdir(parents=True, exist_ok=True)
        for name in BINARIES:
            source = unpacked / "usr" / "bin" / name
            if not source.is_file():
                raise InstallFailed(f"{debs[-1].name} has no usr/bin/{name}")
            shutil.copy2(source, dest / "bin" / name)
        (dest / "VERSION").write_text(debs[-1].name + "\n")
        try:
            _install_web(folder, unpacked, dest)
        except (InstallFailed, OSError) as exc:
            print(f"note: Prometheus's web UI not installed ({exc}); its HTTP API works")


def _install_web(folder: Path, unpacked: Path, dest: Path) -> None:
    _run(["apt-get", "download", *UI_PACKAGES], folder)
    for deb in sorted(folder.glob("*.deb")):
        if not deb.name.startswith(f"{PACKAGE}_"):
            _run(["dpkg", "-x", str(deb), str(unpacked)], folder)
    source = unpacked / "usr" / "share" / "prometheus" / "web"
    web = dest / "web"
    if web.exists():
        shutil.rmtree(web)
    shutil.copytree(source, web, symlinks=True)
    # The static folder links (relatively) into usr/share/javascript: copy what they point at.
    # (copytree(symlinks=False) cannot: it checks relative links against the working folder.)
    for link in sorted(path for path in web.rglob("*") if path.is_symlink()):
        target = (source / link.relative_to(web)).resolve()
        if not target.is_relative_to(unpacked.resolve()) or not target.exists():
            raise InstallFailed(f"{link.relative_to(web)} links to {target}, not unpacked")
        link.unlink()
        if target.is_dir():
            # moment-timezone's raw tz database (200 MB) is not what the UI loads.
            shutil.copytree(target, link, ignore=shutil.ignore_patterns("data"))
        else:
            shutil.copy2(target, link)


def _run(argv: list[str], cwd: Path) -> None:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise InstallFailed(f"{' '.join(argv)} exited with {result.returncode}: {detail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.devtools.install_prometheus")
    parser.add_argument("dest", type=Path, help="install into DEST/bin (e.g. .venv/prometheus)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when it cannot install")
    args = parser.parse_args(argv)
    if on_path() or installed(args.dest):
        return 0
    try:
        install(args.dest)
    except InstallFailed as exc:
        print(
            f"WARNING: could not install Prometheus into {args.dest}: {exc}\n"
            "  The tests that need Prometheus will fail until there is one: put `prometheus` and\n"
            "  `promtool` (2.x) on PATH, or unpack Debian's package by hand:\n"
            f"  apt-get download {PACKAGE} && dpkg -x {PACKAGE}_*.deb X && "
            f"mkdir -p {args.dest}/bin && cp X/usr/bin/prometheus X/usr/bin/promtool "
            f"{args.dest}/bin/",
            file=sys.stderr,
        )
        return 1 if args.strict else 0
    print(f"installed {', '.join(BINARIES)} into {args.dest / 'bin'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

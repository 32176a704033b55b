"""The committed gRPC stubs are exactly what ``make proto`` generates from ``proto/``."""

import subprocess
import sys
from pathlib import Path

from services.devtools import protogen


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    # protoc runs in its own process, exactly as `make proto` runs it.
    done = subprocess.run(
        [sys.executable, "-m", "services.devtools.protogen", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    generated = {
        p.relative_to(tmp_path): p.read_text()
        for p in tmp_path.rglob("*")
        if p.is_file() and p.suffix in {".py", ".pyi"}
    }
    committed = {
        p.relative_to(protogen.OUTPUT_ROOT): p.read_text()
        for p in protogen.OUTPUT_ROOT.rglob("*")
        if p.is_file() and p.suffix in {".py", ".pyi"}
    }
    assert generated.keys() == committed.keys(), "run `make proto`: stub files differ"
    stale = sorted(str(path) for path, text in generated.items() if committed[path] != text)
    assert not stale, f"run `make proto`: stale stubs {stale}"


def test_every_proto_declares_the_versioned_package() -> None:
    for proto in protogen.proto_files():
        assert "package pdserve.v1;" in proto.read_text(), proto

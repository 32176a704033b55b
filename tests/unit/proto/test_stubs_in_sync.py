"""The committed gRPC stubs are exactly what ``make proto`` generates from ``proto/``."""

from pathlib import Path

from services.devtools import protogen


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    generated = {p.relative_to(tmp_path): p.read_text() for p in written}
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

"""``pdserve up --model A --model B,...``: each model's own pools and layouts, engines named
over every model, and what several models cannot be given."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.cli.up_children import engine_children
from services.cli.up_models import up_models


def parsed(*argv: str) -> object:
    return build_parser().parse_args(["up", *argv])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_each_model_has_its_own_pools_and_layouts(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    args = parsed(
        "--prefill-replicas",
        "2",
        "--model",
        str(first),
        "--model",
        f"{second},prefill-replicas=1,prefill-pp=2,decode-tp=2",
    )
    children = engine_children(args, up_models(args, None), [], tmp_path, {})  # type: ignore[arg-type]
    seen = [
        (c.name, flag(c.argv, "--model"), flag(c.argv, "--pp"), flag(c.argv, "--tp"))
        for c in children
    ]
    assert seen == [
        ("prefill-0", str(first), "1", "1"),
        ("prefill-1", str(first), "1", "1"),
        ("prefill-2", str(second), "2", "1"),
        ("decode-0", str(first), "1", "1"),
        ("decode-1", str(second), "1", "2"),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/a/m", "--model", "/b/m"], "two --model folders are named m"),
        (["--model", "/a/m", "--model", "/b/n", "--autoscale"], "--autoscale sizes one model"),
        (["--model", "/a/m,decode-pp=0"], "decode-pp must be a positive integer"),
    ],
)
def test_what_several_models_cannot_be_given_is_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        up_models(parsed(*argv), None)  # type: ignore[arg-type]


def test_an_unknown_option_of_a_model_is_refused_naming_the_options() -> None:
    with pytest.raises(SystemExit):
        parsed("--model", "/a/m,prefil-replicas=2")

"""``pdserve up``'s router front end (vLLM's) reads the engines' checkpoint, or for the engines
that load none (stub, sim) a synthetic checkpoint of the model they register, written into the
work folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.cli.main import build_parser
from services.cli.main import main as cli_main
from services.cli.model_spec import ModelSpec, parse_model_spec
from services.cli.up_children import frontend_argv
from services.cli.up_models import up_models
from services.engines.registry import UnknownEngine, synthetic_model
from services.engines.sim.profile import DEFAULT_PROFILE, load_profile
from services.engines.stub.backend import STUB_MODEL, StubOptions
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint
from services.tokenization.tokenizer import ByteTokenizer, load_tokenizer


def frontend_of(*argv: str, model: Path | None, work_dir: Path) -> list[str]:
    args = build_parser().parse_args(["up", "--work-dir", str(work_dir), *argv])
    return frontend_argv(args, up_models(args, model))


def served(argv: list[str]) -> list[ModelSpec]:
    """The router's ``--model`` values in ``argv``, parsed as the router reads them."""
    prefix = "--model="
    specs = [arg[len(prefix) :] for arg in argv if arg.startswith(prefix)]
    return [parse_model_spec(spec, {"name"}) for spec in specs]


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_an_engine_with_a_checkpoint_gets_it_read_by_the_front_end(
    engine: str, tmp_path: Path
) -> None:
    argv = frontend_of(
        "--engine",
        engine,
        "--engine-arg=--max-model-len=256",
        "--frontend-arg=--a",
        model=tmp_path,
        work_dir=tmp_path,
    )
    context = "--frontend-arg=--max-model-len=256"  # the engines' context is the front end's
    assert argv == [f"--model={tmp_path.resolve()}", "--frontend-arg=--a", context]


def test_each_model_gets_a_front_end_with_its_own_flags(tmp_path: Path) -> None:
    """``pdserve up --model A --model B,...``: the router serves both, in order, each model's
    ``frontend-arg`` for its own front end only, the run's flags for both."""
    first, second = tmp_path / "a", tmp_path / "b,c"  # (a comma in a folder's name)
    argv = frontend_of(
        "--model",
        str(first),
        "--model",
        f"{second},decode-tp=2,frontend-arg=--chat-template=x,y.jinja",
        "--frontend-arg=--a",
        model=None,
        work_dir=tmp_path,
    )
    specs = served(argv)
    assert [(spec.path, spec.frontend_args) for spec in specs] == [
        (first.resolve(), ()),
        (second.resolve(), ("--chat-template=x,y.jinja",)),
    ]
    assert argv[-1] == "--frontend-arg=--a"


def test_stub_engines_get_a_synthetic_checkpoint_of_their_model(tmp_path: Path) -> None:
    argv = frontend_of("--engine", "stub", model=None, work_dir=tmp_path)
    [spec] = served(argv)
    folder = spec.path
    assert folder == (tmp_path / f"{STUB_MODEL}-checkpoint").resolve()
    assert spec.options == {"name": STUB_MODEL}
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == StubOptions().vocab_size
    assert config["max_position_embeddings"] == StubOptions().max_model_len
    sized = frontend_of(
        "--engine", "stub", "--engine-arg=--stub-vocab-size=384", model=None, work_dir=tmp_path
    )
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 384
    assert served(sized)[0].options == {"name": STUB_MODEL}


def test_sim_engines_get_the_synthetic_checkpoint_of_their_profile(tmp_path: Path) -> None:
    profile = load_profile(DEFAULT_PROFILE)
    [spec] = served(frontend_of("--engine", "sim", model=None, work_dir=tmp_path))
    assert spec.options == {"name": profile.served_model}
    config = json.loads((spec.path / "config.json").read_text())
    assert config["vocab_size"] == profile.model.vocab_size
    assert config["max_position_embeddings"] == profile.model.max_model_len
    with pytest.raises(UnknownEngine):
        synthetic_model("reference")


def test_the_synthetic_tokenizer_is_the_byte_tokenizer_the_engines_count_in(
    tmp_path: Path,
) -> None:
    """Prompt ids are the UTF-8 bytes after BOS, as the byte tokenizer gives them (through
    transformers, which vLLM's renderer uses, and through pdserve's loader); the ids past the
    bytes and specials read as the synthetic engines write them."""
    folder = write_synthetic_checkpoint(tmp_path / "m", vocab_size=1000, max_model_len=64)
    text = "Hello, wörld! <s> and </s>"
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert hf(text)["input_ids"] == ByteTokenizer().encode(text)
    assert load_tokenizer(folder).encode(text) == ByteTokenizer().encode(text)
    assert load_tokenizer(folder).eos_token_ids == {257}
    assert len(hf) == 1000
    assert hf.decode([300, 999, 72, 105]) == " t300 t999Hi"
    rendered = hf.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == "<s>user: hi\nassistant: yo\nassistant:"
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    write_synthetic_checkpoint(folder, vocab_size=1000, max_model_len=64)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_make_synthetic_checkpoint_prints_the_folder_and_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["make-synthetic-checkpoint", str(tmp_path / "s"), "--engine", "stub"]) == 0
    folder, name = capsys.readouterr().out.split()
    assert (Path(folder), name) == ((tmp_path / "s").resolve(), STUB_MODEL)
    assert (Path(folder) / "tokenizer.json").is_file()

"""The ``--model DIR[,KEY=VALUE...]`` spelling of one served base model, as ``pdserve up`` and
``pdserve router`` take it (repeated, one base model each).

``DIR`` is the model's checkpoint folder; each ``KEY=VALUE`` sets one of that model's options
(which keys a command takes is its own: ``pdserve up`` its pools' layouts, both a front-end
flag). ``frontend-arg`` may repeat; a part after a comma that does not start with a known key
belongs to what is before it (a folder or a vLLM flag whose value holds commas, such as
JSON); one that looks like an unknown ``key=`` is refused, naming the keys.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

FRONTEND_ARG = "frontend-arg"
"""The key of a vLLM server flag for the model's front end (repeatable)."""


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` value, parsed."""

    path: Path
    options: dict[str, str] = field(default_factory=dict)
    """Every key but ``frontend-arg``, as given."""
    frontend_args: tuple[str, ...] = ()

    def integer(self, key: str, default: int) -> int:
        """Option ``key`` as a positive integer (``default`` when not given); ``ValueError``
        naming the model otherwise."""
        value = self.options.get(key)
        if value is None:
            return default
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"--model {self.path}: {key} must be a positive integer, not {value!r}"
            )
        return int(value)


def parse_model_spec(text: str, keys: Collection[str]) -> ModelSpec:
    """``text`` (``DIR[,KEY=VALUE...]``) with ``keys`` (and ``frontend-arg``) allowed;
    ``argparse.ArgumentTypeError`` naming what is wrong (argparse prints it as usage)."""
    allowed = {*keys, FRONTEND_ARG}
    path, *parts = text.split(",")
    items: list[list[str]] = []
    for part in parts:
        key, equals, value = part.partition("=")
        if equals and key in allowed:
            items.append([key, value])
        elif items:  # a comma inside the value before it
            items[-1][1] += "," + part
        elif equals and key.replace("-", "").isalpha():
            raise argparse.ArgumentTypeError(
                f"--model {text!r}: unknown option {key!r} (options: {', '.join(sorted(allowed))})"
            )
        else:  # a comma inside the folder's path
            path += "," + part
    if not path:
        raise argparse.ArgumentTypeError(f"--model {text!r}: the model's folder comes first")
    options: dict[str, str] = {}
    flags: list[str] = []
    for key, value in items:
        if key == FRONTEND_ARG:
            flags.append(value)
        elif key in options:
            raise argparse.ArgumentTypeError(f"--model {text!r}: {key} given twice")
        else:
            options[key] = value
    return ModelSpec(Path(path), options, tuple(flags))


def format_model_spec(path: Path, options: dict[str, str], frontend_args: Collection[str]) -> str:
    """The ``--model`` value :func:`parse_model_spec` reads back as ``path`` with ``options``
    and ``frontend_args``."""
    parts = [str(path), *(f"{key}={value}" for key, value in options.items())]
    parts.extend(f"{FRONTEND_ARG}={flag}" for flag in frontend_args)
    return ",".join(parts)

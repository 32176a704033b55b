"""``pdserve profile``: measure a running layout into a profile the simulated engine and the
planner read (:mod:`services.bench.profile` measures and fits; this module parses flags, writes
the file and prints the summary).

The layout is started beforehand (``pdserve up``, or engines and a router of one's own): the
command reads its engines from the control plane (``--redis``, ``--namespace`` or the
environment, as ``pdserve status``) and sends its requests to ``--router``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

from services.config import ControlPlaneSettings

HELP = (
    "measure a running engine layout (TTFT against input length, ITL against batch and "
    "context, KV capacity) into a profile for --engine sim and pdserve planner"
)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a list of positive integers is needed: {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--router", metavar="URL", required=True, help="the router in front of the layout"
    )
    parser.add_argument(
        "--model-config",
        metavar="PATH",
        type=Path,
        required=True,
        help="the served model's config.json (or its folder): head size, vocabulary, dtype",
    )
    parser.add_argument(
        "--served-model",
        metavar="NAME",
        help="profile the pools of this base model only (a router serving several; the name "
        "its engines register)",
    )
    parser.add_argument("--out", metavar="FILE", type=Path, required=True, help="profile file")
    parser.add_argument("--name", help="the profile's name (default: the output file's stem)")
    parser.add_argument(
        "--input-lengths",
        type=_lengths,
        default=(32, 128, 512, 2048),
        metavar="N,N,...",
        help="prompt lengths of the TTFT sweep (default 32,128,512,2048)",
    )
    parser.add_argument(
        "--batches",
        type=_lengths,
        default=(1, 4, 16),
        metavar="N,N,...",
        help="concurrent streams of the ITL sweep (default 1,4,16)",
    )
    parser.add_argument(
        "--contexts",
        type=_lengths,
        default=(128, 1024),
        metavar="N,N,...",
        help="prompt lengths of the ITL sweep's streams (default 128,1024)",
    )
    parser.add_argument(
        "--output-tokens",
        type=int,
        default=32,
        help="tokens each ITL stream generates at first (doubled until the window where every "
        "stream decodes holds 16 gaps of each)",
    )
    parser.add_argument(
        "--max-output-tokens",
        type=int,
        default=1024,
        help="the most tokens an ITL stream is doubled to (and the engines' context allows)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="requests per TTFT point")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="the engines' token budget per step (not measured; default vLLM's 8192)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="the engines' running sequences at most (not measured; default vLLM's 256)",
    )


def run(args: argparse.Namespace, control_plane: ControlPlaneSettings) -> int:
    from services.bench.profile import (  # noqa: PLC0415
        ProfileError,
        Sweep,
        profile_layout,
        read_model_geometry,
        summary,
    )

    name = args.name or args.out.stem
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name):
        print(
            f"pdserve profile: a profile name is [A-Za-z0-9._-]{{1,64}}: {name!r}", file=sys.stderr
        )
        return 2
    if args.output_tokens < 2 or args.repeats < 1:
        print("pdserve profile: --output-tokens >= 2 and --repeats >= 1", file=sys.stderr)
        return 2
    sweep = Sweep(
        input_lengths=args.input_lengths,
        batches=args.batches,
        contexts=args.contexts,
        output_tokens=args.output_tokens,
        repeats=args.repeats,
        max_output_tokens=max(args.max_output_tokens, args.output_tokens),
    )
    try:
        geometry = read_model_geometry(args.model_config)
        profile = asyncio.run(
            profile_layout(
                args.router.rstrip("/"),
                control_plane,
                name=name,
                geometry=geometry,
                sweep=sweep,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                model=args.served_model,
            )
        )
    except ProfileError as exc:
        print(f"pdserve profile: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.model_dump_json(indent=2, exclude_none=True) + "\n")
    print(summary(profile))
    print(f"wrote {args.out}")
    return 0

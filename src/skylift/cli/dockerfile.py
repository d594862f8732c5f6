"""``skylift dockerfile [--config RUN.yaml] [--base python|cuda] [--out Dockerfile]``.

Without ``--out`` the Dockerfile is printed; with it, it is written together with a
``.dockerignore`` beside it (an existing one is kept).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="RUN.yaml", help="the run config the image starts")
    parser.add_argument(
        "--base",
        default="python",
        choices=("python", "cuda"),
        help="python: slim Python (the torch wheels bundle CUDA; default); cuda: nvidia/cuda runtime",
    )
    parser.add_argument(
        "--out", default=None, metavar="PATH", help="write the Dockerfile here (and .dockerignore beside it)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")


def execute(args: argparse.Namespace) -> int:
    from pathlib import Path

    from skylift.doctor.dockerfile import image_spec, render_dockerfile, write_files

    text = render_dockerfile(image_spec(Path.cwd(), base=args.base, config_path=args.config))
    if args.out is None:
        print(text, end="")
        return 0
    for path in write_files(text, Path(args.out), force=args.force):
        print(f"wrote {path}")
    return 0

"""``skylift dockerfile [--config RUN.yaml] [--base python|cuda] [--out Dockerfile] [-- python train.py ARGS]``.

Without ``--out`` the Dockerfile is printed; with it, it is written together with a
``.dockerignore`` beside it (an existing one is kept) and, outside skylift's own checkout,
the wheel of this skylift into ``skylift-wheel/`` of the project folder (the build
context), which the Dockerfile installs. With a script after ``--`` the
image runs it under ``skylift launch``; otherwise ``skylift run`` on the config.
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
    parser.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- SCRIPT [ARGS ...]",
        help="a script project: the image runs skylift launch -- python train.py ARGS (or -- -m pkg.module); "
        "--config then only sizes /dev/shm",
    )


def execute(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from skylift.image.dockerfile import image_spec, render_dockerfile, write_files
    from skylift.image.wheel import write_skylift_wheel

    script = args.script_command[1:] if args.script_command[:1] == ["--"] else args.script_command
    project = Path.cwd()
    spec = image_spec(project, base=args.base, config_path=args.config, script=script or None)
    text = render_dockerfile(spec)
    if args.out is None:
        print(text, end="")
        if spec.skylift_wheel:
            print(f"skylift dockerfile: this Dockerfile installs {spec.skylift_wheel}; "
                  "--out writes it into the project folder with the Dockerfile", file=sys.stderr)
        return 0
    written = write_files(text, Path(args.out), force=args.force)
    if spec.skylift_wheel:
        written.append(write_skylift_wheel(Path(spec.skylift_wheel).parent))  # relative: the project is the cwd
    for path in written:
        print(f"wrote {path}")
    return 0

"""``skylift`` entry point: parse, dispatch to one command module, map errors to exit codes.

Only argparse is imported up front, so ``skylift --help`` answers at once.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import sys
from types import ModuleType

__all__ = ["build_parser", "main"]

# command name -> module in skylift.cli with add_arguments(parser) and execute(args) -> int
COMMANDS = {
    "run": ("run", "Train from a config: in this process, or on --nproc workers through torchrun."),
    "launch": ("launch", "Run any unmodified torchrun-style script on --nproc workers."),
    "check": ("check", "Validate a config and print it fully resolved (nothing is started)."),
    "shard": ("shard", "Write a dataset as tar shards + index to a folder or object store, for streaming."),
    "report": ("report", "Write a run folder's HTML dashboard and PNGs (RUN_DIR/report/index.html)."),
    "monitor": ("monitor", "Watch a run live in the terminal, from its metrics.jsonl (any node)."),
    "doctor": ("doctor", "Check this machine (driver, torch build, GPUs, /dev/shm, NCCL) for a job; say what to fix."),
    "dockerfile": ("dockerfile", "Write a Dockerfile (and .dockerignore) for this project that runs skylift run."),
    "submit": ("submit", "Send a run to SageMaker, PAI-DLC, TI-ONE, Kubernetes or SkyPilot (--dry-run prints it)."),
    "jobs": ("jobs", "Status, logs, stop or watch of a job that skylift submit started."),
    "catalog": ("catalog", "Cloud GPU instances with hardware, interconnect and sourced on-demand/spot prices."),
    "bench": ("bench", "Measure a short real run of a config here: speed, step breakdown, memory, MFU, save time."),
    "plan": ("plan", "Rank instances x count x spot for a job by predicted hours and dollars, from a bench."),
    "export": ("export", "Write a run's trained model as a Hugging Face folder (save_pretrained, safetensors)."),
}


def build_parser() -> argparse.ArgumentParser:
    from skylift import __version__

    parser = argparse.ArgumentParser(
        prog="skylift",
        description="Take a PyTorch training job from a laptop to rented cloud GPUs.",
        epilog="Start with: skylift run examples/quickstart.yaml",
    )
    parser.add_argument("--version", action="version", version=f"skylift {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        _module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from skylift.errors import EXIT_CONFIG_ERROR, SkyliftConfigError

    # Freeze the heap at exit instead of the interpreter's last collections walking every object
    # torch left: ~0.3 s of CPU for a process that only imported it, ~1 s for one that trained
    # (see skylift.cli.run._skip_collections_at_exit); reference counting still frees what it
    # frees. Registered first, so called after every exit handler a command or library adds.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    parser = build_parser()
    argv, script = _split_script(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if script is not None:
        args.script_command = script
    if args.command is None:
        parser.print_help()
        return EXIT_CONFIG_ERROR
    try:
        return _module(COMMANDS[args.command][0]).execute(args)
    except SkyliftConfigError as error:
        print(f"skylift {args.command}: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        print(f"skylift {args.command}: interrupted", file=sys.stderr)
        return 130


def _split_script(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``(argv before --, the script after it)`` for a command whose module sets
    ``SCRIPT_AFTER_DASHES`` (``skylift submit``); ``(argv, None)`` otherwise."""
    command = argv[0] if argv else None
    if command not in COMMANDS or "--" not in argv or not getattr(_module(COMMANDS[command][0]),
                                                                  "SCRIPT_AFTER_DASHES", False):
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"skylift.cli.{name}")

"""``skylift monitor [RUN_DIR]``: a live terminal view of a run from its metrics.jsonl."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None,
                        help="a run folder (default: the newest folder under runs/)")
    parser.add_argument("--interval-s", type=float, default=2.0, help="seconds between refreshes (default 2)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit (for scripts and tests)")


def execute(args: argparse.Namespace) -> int:
    from skylift.cli.report import missing_metrics_message, newest_run_dir
    from skylift.errors import EXIT_CONFIG_ERROR

    if args.interval_s <= 0:
        print("skylift monitor: --interval-s must be above 0", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    run_dir = Path(args.run_dir) if args.run_dir is not None else newest_run_dir(Path("runs"))
    if run_dir is None:
        print("skylift monitor: no run folder under runs/ (none has a metrics.jsonl)\n"
              "Next: skylift run examples/quickstart.yaml", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    # A run that has not written its first record yet is worth waiting for; a typo is not.
    if not (run_dir / "metrics.jsonl").is_file() and (args.once or not run_dir.is_dir()):
        print(missing_metrics_message("skylift monitor", run_dir), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from skylift.monitor.live import watch

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a live view ends
        watch(run_dir, interval_s=args.interval_s, once=args.once)
    return 0

"""``skylift report RUN_DIR``: write RUN_DIR/report/index.html (self-contained) and PNGs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holds metrics.jsonl)")
    parser.add_argument("--output", default=None, metavar="DIR", help="where to write (default RUN_DIR/report)")
    parser.add_argument("--json", action="store_true", help='print {"html", "pngs", "diagnosis", "flops"} as JSON')


def execute(args: argparse.Namespace) -> int:
    from skylift.errors import EXIT_CONFIG_ERROR

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        print(missing_metrics_message("skylift report", run_dir), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from skylift.monitor.report import diagnosis_lines, membership_lines, write_report

    report = write_report(run_dir, args.output)
    if args.json:
        print(json.dumps({"html": str(report.html_path), "pngs": [str(p) for p in report.png_paths],
                          "diagnosis": report.diagnosis,
                          "flops": report.flops.as_dict() if report.flops is not None else None}, indent=2))
        return 0
    print(f"report: {report.html_path}")
    for line in membership_lines(report.membership):
        print(f"membership: {line}")
    for line in diagnosis_lines(report.diagnosis, report.diagnosis_note):
        print(f"diagnosis: {line}")
    for name, shown in report.flops.rows() if report.flops is not None else ():
        print(f"{name}: {shown}")
    return 0


def missing_metrics_message(command: str, run_dir: Path) -> str:
    """Name what is missing and end with the command to run next."""
    what = "does not exist" if not run_dir.exists() else "has no metrics.jsonl"
    newest = newest_run_dir(Path("runs"))
    if newest is not None and newest.resolve() != run_dir.resolve():
        hint = f"Next: {command} {newest}"
    else:
        hint = f"Next: skylift run examples/quickstart.yaml --set run_dir={run_dir}"
    return f"{command}: {run_dir} {what} (looked for {run_dir / 'metrics.jsonl'})\n{hint}"


def newest_run_dir(root: Path) -> Path | None:
    """The run folder under ``root`` whose metrics.jsonl changed last."""
    candidates = [path for path in root.glob("*/metrics.jsonl") if path.is_file()] if root.is_dir() else []
    if not candidates:
        return None
    return max(candidates, key=lambda path: path.stat().st_mtime).parent

"""A worker of ``skylift run``: what torchrun starts on every rank.

Usage: ``python -m skylift.cli.worker CONFIG [--set K=V ...] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import TYPE_CHECKING

from skylift.errors import EXIT_CONFIG_ERROR, EXIT_FAILURE, SkyliftConfigError, SkyliftError

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.monitor.flop_figures import FlopFigures
    from skylift.monitor.report import Report
    from skylift.train.trainer import RunSummary

__all__ = ["train_and_report"]


def train_and_report(config: RunConfig, *, as_json: bool = False) -> int:
    """Train with ``config``; rank 0 prints the summary. Returns the exit code."""
    from skylift.logs import setup_logging
    from skylift.train.trainer import Trainer

    setup_logging()
    if as_json:
        config.monitor.progress_bar = False
    try:
        trainer = Trainer(config)  # opens the checkpoint store: its errors are messages too
        summary = trainer.fit()
    except SkyliftConfigError:
        raise
    except SkyliftError as error:  # lease held, corrupt checkpoint, storage: a message, not a traceback
        print(f"skylift run: {error}", file=sys.stderr)
        return EXIT_FAILURE
    if trainer.runtime.dist.is_main:
        from skylift.monitor.flop_figures import run_dir_flop_figures

        report, flops = trainer.report, run_dir_flop_figures(trainer.run_dir.root)
        if as_json:
            print(json.dumps({**summary.as_dict(), **_report_fields(report), **(flops.as_dict() if flops else {})},
                             indent=2))
        else:
            print_summary(summary, report, flops)
    from skylift.loop.agreement import StopReason

    stopped = StopReason.of_label(summary.stopped_early)
    if stopped is StopReason.GUARD and trainer.runtime.dist.is_main:
        print(f"skylift: stopped by a guard at step {summary.steps} (see the guard record in metrics.jsonl); "
              "raise the limit in monitor.guards, then run the same command to resume", file=sys.stderr)
    if stopped is StopReason.PREEMPTED and trainer.runtime.dist.is_main:
        print(f"skylift: preempted at step {summary.steps}; run the same command again to resume", file=sys.stderr)
    return stopped.exit_code


def _report_fields(report: Report | None) -> dict:
    if report is None:
        return {}
    return {"report": str(report.html_path), "diagnosis": report.diagnosis}


def print_summary(summary: RunSummary, report: Report | None = None, flops: FlopFigures | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="skylift: run finished", show_header=False, title_justify="left")
    for name, value in summary.eval_metrics.items():
        shown = f"{100 * value:.2f}%" if name == "accuracy" else f"{value:.4f}"
        table.add_row(f"validation {name}", shown)
    table.add_row("samples/s", f"{summary.samples_per_s:,.0f}")
    table.add_row("steps", f"{summary.steps} ({summary.epochs_completed} epochs, {summary.samples_seen:,} samples)")
    table.add_row("train time", f"{summary.train_time_s:.1f} s")
    table.add_row("precision", f"{summary.precision} ({summary.precision_reason})")
    table.add_row("processes", f"{summary.world_size} on {summary.device}")
    for name, shown in flops.rows() if flops is not None else ():
        table.add_row(name, escape(shown))
    if summary.resumed_from_step is not None:
        table.add_row("resumed from", f"step {summary.resumed_from_step}")
    if summary.stopped_early:
        table.add_row("stopped early", summary.stopped_early)
    if summary.replicas_agree is not None:
        table.add_row("replicas agree", f"{summary.replicas_agree} (max diff {summary.replica_max_abs_diff:.3g})")
    table.add_row("run folder", summary.run_dir)
    if report is not None:
        from skylift.monitor.report import diagnosis_lines

        for index, line in enumerate(diagnosis_lines(report.diagnosis, report.diagnosis_note)):
            table.add_row("diagnosis" if index == 0 else "", escape(line))  # "[warn]" is text, not markup
        table.add_row("report", str(report.html_path))
    console = Console()
    console.print(table)
    if report is not None:
        console.print(f"Next: open {report.html_path}  (live view of a running job: skylift monitor {summary.run_dir})")
    else:
        console.print(f"Next: tensorboard --logdir {summary.run_dir}/tensorboard")


def main(argv: list[str] | None = None) -> int:
    from skylift.config.load import load_config

    parser = argparse.ArgumentParser(prog="skylift.cli.worker")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--resume", default=None)
    args = parser.parse_args(argv)
    if args.resume is not None:
        args.overrides.append(f"checkpoint.resume={args.resume}")
    try:
        return train_and_report(load_config(args.config, args.overrides), as_json=args.json)
    except SkyliftConfigError as error:
        print(f"skylift run: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    # torchrun's error-file recorder, imported only in workers: it pulls in
    # torch._dynamo, which costs seconds of start-up.
    from torch.distributed.elastic.multiprocessing.errors import record

    from skylift.loop.distributed import exit_cleanly

    try:
        result = record(main)()
        code = EXIT_FAILURE if result is None else result  # record's wrapper is typed Optional; main gives an int
    except Exception:  # noqa: BLE001 - a traceback and EXIT_FAILURE, still through exit_cleanly's teardown
        traceback.print_exc()
        code = EXIT_FAILURE
    exit_cleanly(code)

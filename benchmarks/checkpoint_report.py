"""The checkpoint benchmark's tables (rich), and the issue's targets they are checked against."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TARGET_NOTICE_TO_COMMIT_S", "TARGET_STALL_RATIO", "print_report", "rounded"]

TARGET_STALL_RATIO = 0.10  # async stall <= 10% of the sync save time
TARGET_NOTICE_TO_COMMIT_S = 20.0  # spot notice -> committed checkpoint


def rounded(value: Any, digits: int = 4) -> Any:
    """``value`` with every float rounded (for the JSON)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {key: rounded(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item, digits) for item in value]
    return value


def _spread(samples: list[dict[str, Any]], key: str) -> str:
    values = [sample[key] for sample in samples]
    return f"{statistics.median(values):.2f} ({min(values):.2f}..{max(values):.2f})"


def _met(flag: bool) -> str:
    return "yes" if flag else "NO"


def _group_cpu(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Median CPU seconds per thread group over ``samples``."""
    groups = sorted({group for sample in samples for group in sample["thread_cpu_s"]})
    return {group: statistics.median(s["thread_cpu_s"].get(group, 0.0) for s in samples) for group in groups}


def _cost_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    config, model = report["config"], report["config"]["model"]
    size_gb = next(iter(report["results"].values()))["bytes_per_checkpoint"] / 1e9
    table = Table(title=(
        f"Checkpoint cost: {model['parameters'] / 1e6:.1f}M fp32 parameters + AdamW, {size_gb:.2f} GB per "
        f"checkpoint, {config['repeats']} repeats, {config['threads']} threads; median (min..max)"
    ))  # fmt: skip
    columns = ("target", "sync save s", "async stall s", "stall / sync", "async write+commit s",
               "notice->commit s idle", "notice->commit s during save", "stall <= 10%", "notice <= 20 s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "target" else "right")
    for name, row in report["results"].items():
        met, by_scenario = report["targets_met"][name], row["notice_to_commit_by_scenario_s"]
        table.add_row(
            name, _spread(row["samples"]["sync"], "sync_save_s"), _spread(row["samples"]["async"], "async_stall_s"),
            f"{row['async_stall_ratio']:.3f}", _spread(row["samples"]["async"], "write_commit_s"),
            f"{by_scenario['idle']:.2f}", f"{by_scenario['during_save']:.2f}",
            _met(met["async_stall_ratio_met"]), _met(met["notice_to_commit_met"]),
        )  # fmt: skip
    return table


def _cpu_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=(
        "Where this process's CPU goes during a sync save (median CPU s per thread group; the S3 server runs in its own process); "
        "training step times"
    ))
    for column in ("target", "CPU s / wall s", "CPU s by thread group", "step s", "step s during async write"):
        table.add_column(column, justify="left" if column in ("target", "CPU s by thread group") else "right")
    for name, row in report["results"].items():
        groups = _group_cpu(row["samples"]["sync"])
        total_s = sum(groups.values()) or 1.0
        split = ", ".join(f"{group} {seconds:.2f} ({seconds / total_s:.0%})" for group, seconds in groups.items())
        table.add_row(
            name, f"{row['sync_save_cpu_per_wall']:.2f}", split or "n/a",
            f"{row['train_step_s_after_sync_save']:.3f}", f"{row['train_step_s_during_async_write']:.3f}",
        )  # fmt: skip
    return table


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console

    config = report["config"]
    console = Console(width=160)
    console.print(_cost_table(report))
    console.print(_cpu_table(report))
    for name, row in report["results"].items():
        if "sync_save_server_cpu_s" in row:
            console.print(f"{name}: the S3 server ({row.get('server', 'moto')}) used {row['sync_save_server_cpu_s']:.1f} "
                          f"CPU s per sync save of {row['sync_save_s']:.1f} s")
        if "sync_local_commit_s" in row:
            upload = row["notice_to_upload_by_scenario_s"]
            console.print(f"{name}: committed on the local disk {row['sync_local_commit_s']:.2f} s into a sync save; "
                          f"after a notice, in S3 too at {upload['idle']:.2f} s (idle), "
                          f"{upload['during_save']:.2f} s (during a save)")
    console.print(
        f"load average (1 min) {config['load_average_1m_start']:.2f} at start, {config['load_average_1m_end']:.2f} "
        f"at end, on {config['cpu_count']} CPUs; peak RSS {config['peak_rss_bytes'] / 1e9:.1f} GB (this process; "
        "the S3 server's objects live in its own); notice->commit runs poll every "
        f"{config['poll_interval_s']:g} s"
    )

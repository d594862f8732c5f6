"""Timing and reporting helpers shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import statistics
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from skylift.train.precision import DeviceInfo

Stamp = tuple[float, float]  # (time.perf_counter() s, time.process_time() s)


def clock() -> Stamp:
    """Wall time and this process's CPU time (all threads), in seconds."""
    return time.perf_counter(), time.process_time()


def window_rates(start: Stamp, end: Stamp, samples: int, threads: int) -> dict[str, float]:
    """Samples/s between two stamps, and the CPU share: CPU time / (wall time x threads).

    A CPU share well below what an idle machine gives means other processes took cores.
    """
    wall_s, cpu_s = end[0] - start[0], end[1] - start[1]
    return {"samples_per_s": samples / wall_s, "cpu_share": cpu_s / (wall_s * threads)}


def summarize(runs: dict[str, list[dict[str, float]]], reference: str) -> dict[str, dict[str, Any]]:
    """Median samples/s per contender, its ratio to ``reference``'s, and every run's values."""
    reference_runs = [run["samples_per_s"] for run in runs[reference]]
    reference_samples_per_s = statistics.median(reference_runs)
    summary = {}
    for name, name_runs in runs.items():
        samples_per_s = [run["samples_per_s"] for run in name_runs]
        # Paired: each repeat's ratio to the reference timed in the same rotation, which
        # cancels the machine's slow drift that the ratio of medians keeps.
        paired = [mine / theirs for mine, theirs in zip(samples_per_s, reference_runs, strict=True)]
        summary[name] = {
            "samples_per_s": round(statistics.median(samples_per_s), 3),
            f"ratio_to_{reference}": round(statistics.median(samples_per_s) / reference_samples_per_s, 4),
            f"paired_ratio_to_{reference}": round(statistics.median(paired), 4),
            "all_samples_per_s": [round(value, 3) for value in samples_per_s],
            "all_cpu_share": [round(run["cpu_share"], 3) for run in name_runs],
        }
    return summary


def print_table(title: str, results: dict[str, dict[str, dict[str, Any]]], reference: str) -> None:
    """One row per (precision, contender) of :func:`summarize` results."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    columns = ("precision", "contender", "median samples/s", f"ratio to {reference}", "paired ratio", "min..max",
               "min CPU share")
    for column in columns:
        table.add_column(column, justify="left" if column in ("precision", "contender") else "right")
    for precision, by_name in results.items():
        for name, row in by_name.items():
            low, high = min(row["all_samples_per_s"]), max(row["all_samples_per_s"])
            ratio = f"{row[f'ratio_to_{reference}']:.3f}"
            paired = f"{row[f'paired_ratio_to_{reference}']:.3f}"
            cells = (f"{row['samples_per_s']:.2f}", ratio, paired, f"{low:.2f}..{high:.2f}",
                     f"{min(row['all_cpu_share']):.2f}")
            table.add_row(precision, name, *cells)
    Console(width=120).print(table)


def environment(threads: int, packages: tuple[str, ...]) -> dict[str, Any]:
    """What the numbers depend on besides the code: CPU, threads, versions."""
    return {
        "cpu": DeviceInfo.detect(torch.device("cpu")).name,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "versions": {name: _version_or_none(name) for name in packages},
    }


def _version_or_none(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:  # e.g. moto on a GPU machine that runs only local targets
        return None


def write_report(out: Any, config: dict[str, Any], results: Any, started_s: float,
                 print_report: Any) -> dict[str, Any]:
    """Stamp the elapsed time, print the tables and write ``{"config", "results"}`` to ``out``."""
    import json

    config["elapsed_s"] = round(time.perf_counter() - started_s, 1)
    print_report(config, results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    print(f"\nwrote {out} ({config['elapsed_s']} s)")
    return {"config": config, "results": results}

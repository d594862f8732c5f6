"""Share of step time a real training run spends waiting for data fed by skylift streaming.

``skylift run`` trains ResNet-18 on the CPU from the benchmark's shards on the loopback
store (directly, or through the latency proxy); the Trainer writes each step's
``step_time_s`` and ``data_wait_s`` (time blocked in ``next(batches)``) to
``metrics.jsonl``. The share is sum(data_wait_s) / sum(step_time_s), over all steps and
over the steps after the first: the first one also waits for the DataLoader workers to
start and fetch their first shards, a once-per-run cost that a long run amortises.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.data_loading_contenders import BATCH_SIZE, NUM_WORKERS

__all__ = ["measure_data_wait"]


def _config(run_dir: Path, shards_url: str, endpoint_url: str, steps: int) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir / "run"),
        "seed": 0,
        "device": "cpu",
        "precision": "auto",
        "channels_last": True,
        "recipe": {"name": "image_classification", "model": "resnet18", "num_classes": 10},
        "data": {
            "url": shards_url, "endpoint_url": endpoint_url, "global_batch_size": BATCH_SIZE,
            "num_workers": NUM_WORKERS, "cache_dir": str(run_dir / "cache"), "cache_limit_gib": 4.0,
        },
        "optim": {"name": "adamw", "lr": 0.001},
        "schedule": {"epochs": 1, "max_steps": steps, "lr_schedule": "constant", "warmup_steps": 0},
        "checkpoint": {"enabled": False},
        "monitor": {"log_every_steps": 1, "tensorboard": False, "progress_bar": False},
    }  # fmt: skip


def measure_data_wait(shards_url: str, endpoint_url: str, steps: int, timeout_s: float = 600.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="skylift-bench-train-") as folder:
        run_dir = Path(folder)
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(_config(run_dir, shards_url, endpoint_url, steps)))
        command = [sys.executable, "-m", "skylift", "run", str(config_path), "--resume", "never"]
        finished = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout_s)
        if finished.returncode:
            raise RuntimeError(f"skylift run failed ({finished.returncode}):\n{finished.stderr[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_seen = [record for record in records if record.get("kind") == "train"]
    return summarize_steps(steps_seen)


def summarize_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    def share(selected: list[dict[str, Any]]) -> float:
        step_s = sum(record["step_time_s"] for record in selected)
        return round(sum(record["data_wait_s"] for record in selected) / step_s, 4) if step_s else 0.0

    return {
        "steps": len(steps),
        "data_wait_share": share(steps),
        "data_wait_share_after_first_step": share(steps[1:]),
        "first_step_data_wait_s": round(steps[0]["data_wait_s"], 3) if steps else None,
        "median_step_time_s": round(sorted(record["step_time_s"] for record in steps)[len(steps) // 2], 3),
        "total_data_wait_s": round(sum(record["data_wait_s"] for record in steps), 3),
        "total_step_time_s": round(sum(record["step_time_s"] for record in steps), 3),
    }

"""Monitoring: its cost to training throughput, and ``num_workers: auto`` against a full grid.

1. Overhead: the trainer benchmark's ResNet-18 on the CPU (64x64 synthetic images,
   batch 32, AdamW), run by skylift's Trainer with monitoring off (no system sampler,
   no breakdown, no MFU, no diagnosis, no TensorBoard) and fully on (1 Hz sampler,
   breakdown every 10 steps, MFU, cost ledger, diagnosis, TensorBoard), alternating,
   ``--repeats`` rounds; ``overhead_ratio`` = median samples/s on ÷ off (target >= 0.99).
2. Autotune: a small CNN fed by skylift streaming from local shards of 128x128 JPEGs
   (decoding is the loader's work), trained with every ``data.num_workers`` of the
   tuner's candidates (the grid) and with ``auto``, alternating; ``autotune_ratio_to_grid``
   = median samples/s of ``auto`` ÷ the best grid setting's median (target >= 0.95).
   ``auto`` tries its candidates during the first steps of the run, so its timed
   window starts once it has chosen (``--autotune-s`` per candidate).

Steps are timed from the end of the warm-up steps to the last step's end, by a
step-end callback (worker start-up is outside the window).
``python -m benchmarks.monitoring [--quick]`` writes ``benchmarks/results/monitoring.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import clock, environment, window_rates
from benchmarks.trainer_overhead import BATCH_SIZE, RunSpec, StepClock, skylift_overrides
from skylift.config.load import load_config
from skylift.data.autotune import default_candidates
from skylift.data.datasets import synthetic_images
from skylift.train.trainer import Trainer

RESULTS_DIR = Path(__file__).parent / "results"
MONITOR_OFF = ("monitor.system_interval_s=0", "monitor.breakdown_every_steps=0", "monitor.mfu=false",
               "monitor.diagnose=false", "monitor.tensorboard=false")
MONITOR_FULL = ("monitor.system_interval_s=1", "monitor.breakdown_every_steps=10", "monitor.mfu=true",
                "monitor.diagnose=true", "monitor.tensorboard=true", "monitor.usd_per_hour=3.06",
                "monitor.on_demand_usd_per_hour=9.8")
JPEG_SIDE_PX = 128
JPEG_BATCH = 32


def _timed(config_overrides: list[str], window_start: int, timed_steps: int, samples_per_step: int,
           threads: int) -> dict[str, Any]:
    """Samples/s over steps ``window_start + 1 .. window_start + timed_steps`` of one run.

    An ``auto`` run's window starts no earlier than two steps after its last switch, so
    it times the pick, over the same steps as the grid's runs when the trials end first.
    """
    gc.collect()
    step_clock = StepClock()
    trainer = Trainer(load_config(None, config_overrides), callbacks=[step_clock])
    trainer.fit()
    ends = step_clock.step_ends
    tuner = trainer.tuner
    if tuner is not None:
        if tuner.decided_at_step is None:
            raise RuntimeError("the tuner did not finish its trials; raise --autotune-window-start")
        window_start = max(window_start, tuner.decided_at_step + 2)
    if len(ends) < window_start + timed_steps:
        raise RuntimeError(f"run ended after {len(ends)} steps, before its timed window")
    rates = window_rates(ends[window_start - 1], ends[window_start + timed_steps - 1],
                         samples_per_step * timed_steps, threads)
    sweep = tuner.as_record(0) if tuner is not None else None
    return {**rates, "window_start": window_start, "chosen_num_workers": tuner.chosen if tuner else None,
            "sweep": {k: sweep[k] for k in ("chosen", "results")} if sweep else None}


def _alternate(contenders: dict[str, list[str]], repeats: int, window_start: int, timed_steps: int,
               samples_per_step: int, threads: int) -> dict[str, list[dict[str, Any]]]:
    names = list(contenders)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            with tempfile.TemporaryDirectory(prefix="skylift-bench-") as run_dir:
                run = _timed([*contenders[name], f"run_dir={run_dir}"], window_start, timed_steps,
                             samples_per_step, threads)
            runs[name].append(run)
            print(f"  {repeat + 1}/{repeats} {name:<14} {run['samples_per_s']:8.2f} samples/s  "
                  f"CPU share {run['cpu_share']:.2f}" + (f"  chose {run['chosen_num_workers']}"
                                                         if run["chosen_num_workers"] is not None else ""))
    return runs


def _median(runs: list[dict[str, Any]]) -> float:
    return statistics.median(run["samples_per_s"] for run in runs)


def measure_overhead(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    steps = args.warmup_steps + args.timed_steps
    data = synthetic_images(BATCH_SIZE * steps, 64, 10, 0).train
    spec = RunSpec("fp32", data, args.warmup_steps, args.timed_steps)
    base = [o for o in skylift_overrides(spec, "unused") if not o.startswith(("run_dir=", "monitor.tensorboard"))]
    with _export_targets() as exporting:
        contenders = {"monitor_off": [*base, *MONITOR_OFF], "monitor_full": [*base, *MONITOR_FULL],
                      "monitor_full_exporters": [*base, *MONITOR_FULL, *exporting]}
        runs = _alternate(contenders, args.repeats, args.warmup_steps, args.timed_steps, BATCH_SIZE, threads)
    paired = [on["samples_per_s"] / off["samples_per_s"]
              for on, off in zip(runs["monitor_full"], runs["monitor_off"], strict=True)]
    exporters = _median(runs["monitor_full_exporters"]) / _median(runs["monitor_off"])
    return {
        "overhead_ratio": round(_median(runs["monitor_full"]) / _median(runs["monitor_off"]), 4),
        "paired_overhead_ratio": round(statistics.median(paired), 4),
        "exporters_overhead_ratio": round(exporters, 4),
        "exporters": "cloudwatch (moto_server in its own process on 127.0.0.1), mlflow (SQLite), wandb (offline)",
        "samples_per_s": {name: round(_median(name_runs), 2) for name, name_runs in runs.items()},
        "all_samples_per_s": {name: [round(r["samples_per_s"], 2) for r in rs] for name, rs in runs.items()},
        "all_cpu_share": {name: [round(r["cpu_share"], 3) for r in rs] for name, rs in runs.items()},
        "workload": f"resnet18 64x64 batch {BATCH_SIZE} fp32, {args.timed_steps} timed steps",
    }


@contextlib.contextmanager
def _export_targets() -> Iterator[tuple[str, ...]]:
    """All three exporters on, each to a target on this machine: CloudWatch on a moto
    server in its own process, MLflow in a SQLite file, W&B offline."""
    from benchmarks.data_loading_servers import MotoProcess

    moto = MotoProcess()
    saved = {name: os.environ.get(name) for name in _FAKE_AWS}
    os.environ.update({**_FAKE_AWS, "AWS_ENDPOINT_URL_CLOUDWATCH": moto.endpoint_url})
    try:
        with tempfile.TemporaryDirectory(prefix="skylift-mlflow-") as folder:
            yield ("monitor.exporters=[cloudwatch,mlflow,wandb]", "monitor.wandb.mode=offline",
                   f"monitor.mlflow.tracking_uri=sqlite:///{folder}/mlflow.db")
    finally:
        moto.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_FAKE_AWS = {"AWS_ACCESS_KEY_ID": "benchmark", "AWS_SECRET_ACCESS_KEY": "benchmark", "AWS_DEFAULT_REGION": "us-east-1",
             "AWS_EC2_METADATA_DISABLED": "true"}


def write_jpeg_shards(folder: Path, count: int) -> str:
    """``count`` 128x128 JPEGs (smooth gradients plus noise, ~10 KB) in skylift shards."""
    from PIL import Image

    from skylift.data.shards import ShardWriter
    from skylift.storage import open_store

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, JPEG_SIDE_PX, dtype=np.float32)
    writer = ShardWriter(open_store(str(folder)), shard_size_bytes=2 * 2**20)
    for index in range(count):
        label = index % 10
        base = (ramp[None, :, None] * (label + 1) / 10 + ramp[:, None, None] / 2) % 256
        pixels = np.clip(base + rng.normal(0, 24, (JPEG_SIDE_PX, JPEG_SIDE_PX, 3)), 0, 255).astype(np.uint8)
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
        writer.add({"jpg": encoded.getvalue(), "cls": str(label).encode()})
    writer.close(metadata={"classes": [str(n) for n in range(10)]})
    return str(folder)


def measure_autotune(args: argparse.Namespace, threads: int, cache_dir: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="skylift-jpeg-") as folder:
        url = write_jpeg_shards(Path(folder), args.images)
        steps = args.autotune_window_start + args.timed_steps
        base = [
            "device=cpu", "precision=fp32", "recipe.model=small_cnn", "recipe.width=16", f"data.url={url}",
            f"data.cache_dir={cache_dir}", f"data.global_batch_size={JPEG_BATCH}", "schedule.epochs=100",
            f"schedule.max_steps={steps}", "schedule.warmup_steps=0", "monitor.progress_bar='off'",
            "monitor.tensorboard=false", "checkpoint.enabled=false", "preemption.cloud='off'",
            f"data.autotune_s_per_setting={args.autotune_s}",
        ]  # fmt: skip
        grid = {f"workers_{n}": [*base, f"data.num_workers={n}"] for n in default_candidates()}
        auto_steps = steps + args.autotune_extra_steps  # in case the trials outlast the window start
        contenders = {**grid, "auto": [*base, "data.num_workers=auto", f"schedule.max_steps={auto_steps}"]}
        runs = _alternate(contenders, args.repeats, args.autotune_window_start, args.timed_steps, JPEG_BATCH,
                          threads)
    grid_medians = {name: _median(runs[name]) for name in grid}
    best = max(grid_medians, key=grid_medians.get)
    return {
        "autotune_ratio_to_grid": round(_median(runs["auto"]) / grid_medians[best], 4),
        "best_grid_setting": best,
        "samples_per_s": {name: round(_median(name_runs), 2) for name, name_runs in runs.items()},
        "auto_choices": [run["chosen_num_workers"] for run in runs["auto"]],
        "sweeps": [run["sweep"] for run in runs["auto"]],
        "all_samples_per_s": {name: [round(r["samples_per_s"], 2) for r in rs] for name, rs in runs.items()},
        "workload": f"small_cnn width 16, {args.images} JPEGs {JPEG_SIDE_PX}x{JPEG_SIDE_PX} streamed from local "
                    f"shards, batch {JPEG_BATCH}, {args.timed_steps} timed steps",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: few steps, 1 repeat")
    parser.add_argument("--repeats", type=int, help="alternating rounds (default 5, quick 1)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps per run (default 5, quick 2)")
    parser.add_argument("--timed-steps", type=int, help="timed steps per run (default 40, quick 4)")
    parser.add_argument("--images", type=int, help="JPEGs for the autotune workload (default 2048, quick 256)")
    parser.add_argument("--autotune-s", type=float, default=1.0, help="seconds each candidate is timed for")
    parser.add_argument("--autotune-window-start", type=int, help="untimed steps of autotune-part runs (default 24)")
    parser.add_argument("--autotune-extra-steps", type=int, default=30, help="steps added to auto runs for trials")
    parser.add_argument("--parts", default="overhead,autotune", help="overhead, autotune or both; a part not run "
                        "keeps its figures from the existing output file")
    parser.add_argument("--output", type=Path, help="JSON path (default benchmarks/results/monitoring.json)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.warmup_steps = args.warmup_steps or (2 if args.quick else 5)
    args.timed_steps = args.timed_steps or (4 if args.quick else 40)
    args.images = args.images or (256 if args.quick else 3072)
    args.autotune_window_start = args.autotune_window_start or (12 if args.quick else 24)
    args.output = args.output or RESULTS_DIR / f"monitoring{'_quick' if args.quick else ''}.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = clock()[0]
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    load_start = os.getloadavg()[0]
    parts = set(args.parts.split(","))
    previous = json.loads(args.output.read_text()) if args.output.exists() else {}
    overhead = previous.get("overhead")
    if "overhead" in parts:
        print("monitoring overhead (ResNet-18, CPU)")
        overhead = measure_overhead(args, threads)
    autotune = previous.get("autotune")
    if "autotune" in parts:
        print("num_workers: auto vs the grid (JPEG shards)")
        with tempfile.TemporaryDirectory(prefix="skylift-cache-") as cache_dir:
            autotune = measure_autotune(args, threads, cache_dir)
    if overhead is None or autotune is None:
        raise SystemExit(f"--parts {args.parts}: no earlier figures for the other part in {args.output}")
    result = {
        "overhead_ratio": overhead["overhead_ratio"],
        "autotune_ratio_to_grid": autotune["autotune_ratio_to_grid"],
        "exporters_overhead_ratio": overhead.get("exporters_overhead_ratio"),
        "targets": {"overhead_ratio": 0.99, "exporters_overhead_ratio": 0.99, "autotune_ratio_to_grid": 0.95},
        "overhead": overhead,
        "autotune": autotune,
        "config": {
            "repeats": args.repeats, "warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps,
            "quick": args.quick, "parts_run": sorted(parts), "load_average_1m_start": load_start, "load_average_1m_end": os.getloadavg()[0],
            "elapsed_s": round(clock()[0] - started, 1), **environment(threads, ("torch", "skylift")),
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"overhead_ratio {result['overhead_ratio']} (paired {overhead['paired_overhead_ratio']}), "
          f"autotune_ratio_to_grid {result['autotune_ratio_to_grid']} (best grid: {autotune['best_grid_setting']}, "
          f"auto chose {autotune['auto_choices']})")
    print(f"wrote {args.output} ({result['config']['elapsed_s']} s)")
    return result


if __name__ == "__main__":
    main()

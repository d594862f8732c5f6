"""Trainer overhead: the same ResNet-18, data and AdamW run by four training loops.

``hand_loop`` (plain PyTorch, the reference), ``skylift`` (its Trainer, timed by a
step-end callback), ``accelerate`` and ``fabric``, on the CPU in one process. Every
run builds model, optimizer and loader afresh, runs ``warmup_steps`` untimed steps and
times ``timed_steps`` more. Per precision, each contender runs once untimed, then all
alternate in rotating order for ``repeats`` rounds; a run during which other processes
took cores (CPU share below ``--min-cpu-share``) is rerun. Reported: median samples/s
and its ratio to the hand loop's. ``python -m benchmarks.trainer_overhead [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import Stamp, clock, environment, print_table, summarize, window_rates
from skylift.config.load import load_config
from skylift.data.datasets import synthetic_images
from skylift.loop.events import Callback, TrainState
from skylift.train.precision import DeviceInfo
from skylift.train.trainer import Trainer

MODEL_NAME = "resnet18"
IMAGE_SIZE_PX = 64
NUM_CLASSES = 10
BATCH_SIZE = 32
SEED = 0
LR = 1e-3
WEIGHT_DECAY = 0.01
GRAD_CLIP_NORM = 1.0
RESULTS_DIR = Path(__file__).parent / "results"
SKYLIFT_SETTINGS = (
    "defaults for everything that runs per step (checkpointing on with its time-based policy, which saves "
    "nothing in a timed window; SIGTERM/SIGUSR1 watch), without metadata polling (preemption.cloud=off), "
    "end-of-run saves, TensorBoard or progress bar"
)


@dataclass(frozen=True)
class RunSpec:
    """One training run: what every contender is given."""

    precision: str  # "fp32" or "bf16"
    data: TensorDataset
    warmup_steps: int
    timed_steps: int

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.timed_steps


def build_model_and_optimizer(seed: int = SEED) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same init as skylift's Trainer (seed, then build); its weight-decay grouping."""
    torch.manual_seed(seed)
    model = getattr(torchvision.models, MODEL_NAME)(weights=None, num_classes=NUM_CLASSES)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=LR, foreach=True)


def plain_loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True, num_workers=0)


def train_steps(loader: Any, total_steps: int, step: Callable[[torch.Tensor, torch.Tensor], None]) -> list[Stamp]:
    """Run ``step`` on ``total_steps`` batches; return the clock at each step's end."""
    step_ends: list[Stamp] = []
    for images, labels in loader:
        step(images, labels)
        step_ends.append(clock())
        if len(step_ends) == total_steps:
            break
    return step_ends


def bf16_autocast(precision: str) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def run_hand_loop(spec: RunSpec) -> list[Stamp]:
    model, optimizer = build_model_and_optimizer()
    parameters = list(model.parameters())

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with bf16_autocast(spec.precision):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, GRAD_CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_steps(plain_loader(spec.data), spec.total_steps, step)


@dataclass
class StepClock(Callback):
    """Records when each optimizer step of a skylift run ended (after the metrics logger)."""

    step_ends: list[Stamp] = field(default_factory=list)

    def on_step_end(self, state: TrainState) -> None:
        self.step_ends.append(clock())


def skylift_overrides(spec: RunSpec, run_dir: str) -> list[str]:
    return [
        f"run_dir={run_dir}", f"seed={SEED}", "device=cpu", f"precision={spec.precision}",
        f"recipe.model={MODEL_NAME}", f"recipe.num_classes={NUM_CLASSES}",
        "recipe.dataset=synthetic_images", f"recipe.image_size={IMAGE_SIZE_PX}",
        f"recipe.num_samples={len(spec.data)}", f"data.global_batch_size={BATCH_SIZE}", "data.num_workers=0",
        "optim.name=adamw", f"optim.lr={LR}", f"optim.weight_decay={WEIGHT_DECAY}",
        "optim.implementation=foreach", f"optim.grad_clip_norm={GRAD_CLIP_NORM}",
        "schedule.lr_schedule=constant", "schedule.warmup_steps=0", "schedule.epochs=1",
        f"schedule.max_steps={spec.total_steps}",
        "monitor.tensorboard=false", "monitor.progress_bar='off'", "checkpoint.save_final_model=false",
        "checkpoint.save_at_end=false", "preemption.cloud='off'",
    ]  # fmt: skip


def run_skylift(spec: RunSpec) -> list[Stamp]:
    step_clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="skylift-bench-") as run_dir:
        Trainer(load_config(None, skylift_overrides(spec, run_dir)), callbacks=[step_clock]).fit()
    return step_clock.step_ends


def run_accelerate(spec: RunSpec) -> list[Stamp]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the precision may change between runs
    accelerator = Accelerator(mixed_precision="bf16" if spec.precision == "bf16" else "no", cpu=True)
    model, optimizer = build_model_and_optimizer()
    model, optimizer, loader = accelerator.prepare(model, optimizer, plain_loader(spec.data))

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        loss = F.cross_entropy(model(images), labels)  # the prepared forward runs under autocast
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), GRAD_CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_steps(loader, spec.total_steps, step)


def run_fabric(spec: RunSpec) -> list[Stamp]:
    from lightning.fabric import Fabric

    for logger in ("lightning.fabric", "lightning.pytorch"):  # no "Using bfloat16 AMP" line per run
        logging.getLogger(logger).setLevel(logging.WARNING)
    precision = "bf16-mixed" if spec.precision == "bf16" else "32-true"
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    model, optimizer = build_model_and_optimizer()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(plain_loader(spec.data))

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        loss = F.cross_entropy(model(images), labels)  # the set-up forward runs under autocast
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=GRAD_CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_steps(loader, spec.total_steps, step)


CONTENDERS: dict[str, Callable[[RunSpec], list[Stamp]]] = {
    "hand_loop": run_hand_loop, "skylift": run_skylift, "accelerate": run_accelerate, "fabric": run_fabric,
}  # fmt: skip


def timed_run(name: str, spec: RunSpec, threads: int) -> dict[str, float]:
    """One contender's samples/s and CPU share in the timed steps, and the run's wall seconds."""
    gc.collect()
    started_s = time.perf_counter()
    step_ends = CONTENDERS[name](spec)
    wall_s = time.perf_counter() - started_s
    if len(step_ends) != spec.total_steps:
        raise RuntimeError(f"{name} ran {len(step_ends)} steps, expected {spec.total_steps}")
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"{name} changed torch's thread count to {torch.get_num_threads()}")
    rates = window_rates(step_ends[spec.warmup_steps - 1], step_ends[-1], BATCH_SIZE * spec.timed_steps, threads)
    return {**rates, "wall_s": wall_s}


def uncontended_run(name: str, spec: RunSpec, threads: int, args: argparse.Namespace) -> dict[str, float]:
    """:func:`timed_run`, rerun (up to ``args.max_reruns`` times) while other processes took cores."""
    for attempt in range(args.max_reruns + 1):
        run = timed_run(name, spec, threads)
        if run["cpu_share"] >= args.min_cpu_share:
            break
        print(f"  {name}: CPU share {run['cpu_share']:.2f} < {args.min_cpu_share} ({run['samples_per_s']:.2f} "
              f"samples/s): other processes took cores; {'rerun' if attempt < args.max_reruns else 'kept'}")
        time.sleep(args.rerun_wait_s if attempt < args.max_reruns else 0.0)
    return {**run, "reruns": attempt}


def probe(precision: str, args: argparse.Namespace, threads: int) -> dict[str, float]:
    """Time a short hand-loop run: seconds per step and the fixed cost of a run."""
    warmup_steps = args.warmup_steps
    probe_steps = max(3, warmup_steps)
    data = synthetic_images(BATCH_SIZE * (warmup_steps + probe_steps), IMAGE_SIZE_PX, NUM_CLASSES, SEED).train
    run = uncontended_run("hand_loop", RunSpec(precision, data, warmup_steps, probe_steps), threads, args)
    step_s = BATCH_SIZE / run["samples_per_s"]
    return {"step_s": step_s, "run_fixed_s": max(0.0, run["wall_s"] - (warmup_steps + probe_steps) * step_s)}


def plan_timed_steps(probes: dict[str, dict[str, float]], args: argparse.Namespace, spent_s: float) -> int:
    """Timed steps per run so that all runs fit in what is left of the time target."""
    runs_per_precision = len(CONTENDERS) * (args.repeats + 1)  # + the untimed warm-up run
    per_run_s = (args.target_minutes * 60 - spent_s) / runs_per_precision
    step_s = sum(p["step_s"] for p in probes.values())
    fixed_s = sum(p["run_fixed_s"] for p in probes.values())
    return max(args.warmup_steps, int((per_run_s - fixed_s) / step_s) - args.warmup_steps)


def measure_precision(precision: str, args: argparse.Namespace, timed_steps: int, threads: int) -> dict[str, Any]:
    """Warm every contender up once, then time them in rotating order ``args.repeats`` times."""
    data = synthetic_images(BATCH_SIZE * (args.warmup_steps + timed_steps), IMAGE_SIZE_PX, NUM_CLASSES, SEED).train
    names = list(CONTENDERS)
    for name in names:
        timed_run(name, RunSpec(precision, data, args.warmup_steps, args.warmup_steps), threads)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    spec = RunSpec(precision, data, args.warmup_steps, timed_steps)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            run = uncontended_run(name, spec, threads, args)
            runs[name].append(run)
            print(f"  {precision} {repeat + 1}/{args.repeats} {name:<10} {run['samples_per_s']:7.2f} samples/s, "
                  f"CPU share {run['cpu_share']:.2f}")  # fmt: skip
    summary = summarize(runs, reference="hand_loop")
    for name, name_runs in runs.items():
        summary[name]["reruns_for_contention"] = int(sum(run["reruns"] for run in name_runs))
    return summary


def describe_setup(args: argparse.Namespace, threads: int, timed_steps: int) -> dict[str, Any]:
    return {
        "model": MODEL_NAME, "image_size": IMAGE_SIZE_PX, "num_classes": NUM_CLASSES, "batch": BATCH_SIZE,
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True},
        "grad_clip_norm": GRAD_CLIP_NORM, "seed": SEED, "warmup_steps": args.warmup_steps,
        "steps": timed_steps, "repeats": args.repeats, "quick": args.quick, "order": "rotating",
        "min_cpu_share": args.min_cpu_share, "max_reruns": args.max_reruns, "skylift_settings": SKYLIFT_SETTINGS,
        **environment(threads, ("torch", "torchvision", "accelerate", "lightning", "skylift")),
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 timed steps, 2 repeats")
    parser.add_argument("--repeats", type=int, help="timed rounds per precision (default 5, quick 2)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps per run (default 3, quick 1)")
    parser.add_argument("--timed-steps", type=int, help="timed steps per run (default: planned from a probe)")
    parser.add_argument("--target-minutes", type=float, default=6.0, help="time the planned benchmark aims at")
    parser.add_argument("--min-cpu-share", type=float, default=0.9, help="rerun a run below this CPU share")
    parser.add_argument("--max-reruns", type=int, default=3, help="reruns of a contended run (0: none)")
    parser.add_argument("--rerun-wait-s", type=float, default=10.0, help="pause before a rerun, for the load to pass")
    parser.add_argument("--output", type=Path, help="JSON path (default benchmarks/results/trainer_overhead.json)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.warmup_steps = args.warmup_steps or (1 if args.quick else 3)
    args.timed_steps = args.timed_steps or (3 if args.quick else None)
    args.output = args.output or RESULTS_DIR / f"trainer_overhead{'_quick' if args.quick else ''}.json"
    if min(args.repeats, args.warmup_steps, args.timed_steps or 1) < 1:
        parser.error("--repeats, --warmup-steps and --timed-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started_s = time.perf_counter()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)  # once, the same for every contender
    precisions = ["fp32", "bf16"] if DeviceInfo.detect(torch.device("cpu")).cpu_native_bf16 else ["fp32"]
    probes = {} if args.timed_steps else {p: probe(p, args, threads) for p in precisions}
    timed_steps = args.timed_steps or plan_timed_steps(probes, args, time.perf_counter() - started_s)
    print(f"precisions {precisions}, probe {json.dumps(probes)} -> {timed_steps} timed steps per run")
    load_start = os.getloadavg()[0]
    results = {precision: measure_precision(precision, args, timed_steps, threads) for precision in precisions}
    config = describe_setup(args, threads, timed_steps)
    config.update(probe=probes, load_average_1m_start=load_start, load_average_1m_end=os.getloadavg()[0])
    config["elapsed_s"] = round(time.perf_counter() - started_s, 1)
    title = (
        f"Trainer overhead: {MODEL_NAME} {IMAGE_SIZE_PX}x{IMAGE_SIZE_PX}, batch {BATCH_SIZE}, "
        f"{timed_steps} timed steps x {args.repeats} repeats, {threads} threads"
    )
    print_table(title, results, reference="hand_loop")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    print(f"wrote {args.output} ({config['elapsed_s']} s)")
    return {"config": config, "results": results}


if __name__ == "__main__":
    main()

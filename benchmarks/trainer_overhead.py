"""Trainer overhead: one model, data set and optimizer run by four training loops.

Contenders, all on the CPU in one process, with identical work per step (ResNet-18,
64x64 synthetic images from :func:`skylift.data.datasets.synthetic_images`, global
batch 32, AdamW lr 1e-3 with weight decay 0.01 on >= 2-D parameters only, foreach
kernels, gradient clipping to norm 1.0, bf16 autocast where asked):

* ``hand_loop``: a plain PyTorch loop, the reference;
* ``skylift``: :class:`skylift.train.trainer.Trainer`, timed by a step-end callback;
* ``accelerate``: Hugging Face Accelerate (``Accelerator(cpu=True)``);
* ``fabric``: Lightning Fabric (``Fabric(accelerator="cpu", devices=1)``).

Every timed run builds its model, optimizer and loader from scratch (as a Trainer fit
does), runs ``warmup_steps`` untimed steps, then times ``timed_steps`` steps from the
end of the last warm-up step to the end of the last step. Per precision, each
contender first runs once untimed, then the contenders alternate in rotating order for
``repeats`` rounds. Reported: median samples/s and its ratio to the hand loop's.

    .venv/bin/python -m benchmarks.trainer_overhead           # full run, ~6 minutes
    .venv/bin/python -m benchmarks.trainer_overhead --quick   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch.utils.data import DataLoader, TensorDataset

from skylift.config.load import load_config
from skylift.data.datasets import synthetic_images
from skylift.train.events import Callback, TrainState
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


# ---------------------------------------------------------------- shared parts


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


def train_steps(loader: Any, total_steps: int, step: Callable[[torch.Tensor, torch.Tensor], None]) -> list[float]:
    """Run ``step`` on ``total_steps`` batches; return each step's end time (perf_counter s)."""
    step_end_s: list[float] = []
    for images, labels in loader:
        step(images, labels)
        step_end_s.append(time.perf_counter())
        if len(step_end_s) == total_steps:
            break
    return step_end_s


def bf16_autocast(precision: str) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


# ---------------------------------------------------------------- contenders


def run_hand_loop(spec: RunSpec) -> list[float]:
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


class StepClock(Callback):
    """Records when each optimizer step of a skylift run ended (after the metrics logger)."""

    def __init__(self) -> None:
        self.step_end_s: list[float] = []

    def on_step_end(self, state: TrainState) -> None:
        self.step_end_s.append(time.perf_counter())


def skylift_overrides(spec: RunSpec, run_dir: str) -> list[str]:
    return [
        f"run_dir={run_dir}", f"seed={SEED}", "device=cpu", f"precision={spec.precision}",
        f"model.name={MODEL_NAME}", f"model.num_classes={NUM_CLASSES}",
        "data.dataset=synthetic_images", f"data.image_size={IMAGE_SIZE_PX}",
        f"data.num_samples={len(spec.data)}", f"data.global_batch_size={BATCH_SIZE}", "data.num_workers=0",
        "optim.name=adamw", f"optim.lr={LR}", f"optim.weight_decay={WEIGHT_DECAY}",
        "optim.implementation=foreach", f"optim.grad_clip_norm={GRAD_CLIP_NORM}",
        "schedule.lr_schedule=constant", "schedule.warmup_steps=0", "schedule.epochs=1",
        f"schedule.max_steps={spec.total_steps}",
        "monitor.tensorboard=false", "monitor.progress_bar='off'", "checkpoint.save_final_model=false",
    ]  # fmt: skip


def run_skylift(spec: RunSpec) -> list[float]:
    clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="skylift-bench-") as run_dir:
        Trainer(load_config(None, skylift_overrides(spec, run_dir)), callbacks=[clock]).fit()
    return clock.step_end_s


def run_accelerate(spec: RunSpec) -> list[float]:
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


def run_fabric(spec: RunSpec) -> list[float]:
    from lightning.fabric import Fabric

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


CONTENDERS: dict[str, Callable[[RunSpec], list[float]]] = {
    "hand_loop": run_hand_loop,
    "skylift": run_skylift,
    "accelerate": run_accelerate,
    "fabric": run_fabric,
}


# ---------------------------------------------------------------- measurement


def timed_run(name: str, spec: RunSpec, threads: int) -> tuple[float, float]:
    """Run one contender; return (samples/s over the timed steps, wall seconds of the run)."""
    gc.collect()
    started_s = time.perf_counter()
    step_end_s = CONTENDERS[name](spec)
    wall_s = time.perf_counter() - started_s
    if len(step_end_s) != spec.total_steps:
        raise RuntimeError(f"{name} ran {len(step_end_s)} steps, expected {spec.total_steps}")
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"{name} changed torch's thread count to {torch.get_num_threads()}")
    window_s = step_end_s[-1] - step_end_s[spec.warmup_steps - 1]
    return BATCH_SIZE * spec.timed_steps / window_s, wall_s


def probe(precision: str, warmup_steps: int, threads: int) -> dict[str, float]:
    """Time a short hand-loop run: seconds per step and the fixed cost of a run."""
    probe_steps = max(3, warmup_steps)
    data = synthetic_images(BATCH_SIZE * (warmup_steps + probe_steps), IMAGE_SIZE_PX, NUM_CLASSES, SEED).train
    samples_per_s, wall_s = timed_run("hand_loop", RunSpec(precision, data, warmup_steps, probe_steps), threads)
    step_s = BATCH_SIZE / samples_per_s
    return {"step_s": step_s, "run_fixed_s": max(0.0, wall_s - (warmup_steps + probe_steps) * step_s)}


def plan_timed_steps(probes: dict[str, dict[str, float]], args: argparse.Namespace, spent_s: float) -> int:
    """Timed steps per run so that all runs fit in what is left of the time target."""
    runs_per_precision = len(CONTENDERS) * (args.repeats + 1)  # + the untimed warm-up run
    per_run_s = (args.target_minutes * 60 - spent_s) / runs_per_precision
    step_s = sum(p["step_s"] for p in probes.values())
    fixed_s = sum(p["run_fixed_s"] for p in probes.values())
    return max(args.warmup_steps, int((per_run_s - fixed_s) / step_s) - args.warmup_steps)


def measure_precision(precision: str, args: argparse.Namespace, timed_steps: int, threads: int) -> dict[str, Any]:
    data = synthetic_images(BATCH_SIZE * (args.warmup_steps + timed_steps), IMAGE_SIZE_PX, NUM_CLASSES, SEED).train
    names = list(CONTENDERS)
    for name in names:  # untimed warm-up run of every contender
        timed_run(name, RunSpec(precision, data, args.warmup_steps, args.warmup_steps), threads)
    samples_per_s: dict[str, list[float]] = {name: [] for name in names}
    spec = RunSpec(precision, data, args.warmup_steps, timed_steps)
    for repeat in range(args.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            samples_per_s[name].append(timed_run(name, spec, threads)[0])
            print(f"  {precision} repeat {repeat + 1}/{args.repeats} {name}: {samples_per_s[name][-1]:.2f} samples/s")
    reference = statistics.median(samples_per_s["hand_loop"])
    return {
        name: {
            "samples_per_s": round(statistics.median(values), 3),
            "ratio_to_hand_loop": round(statistics.median(values) / reference, 4),
            "all_samples_per_s": [round(value, 3) for value in values],
        }
        for name, values in samples_per_s.items()
    }


# ---------------------------------------------------------------- report


def print_table(results: dict[str, dict[str, Any]], config: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"Trainer overhead: {MODEL_NAME} {IMAGE_SIZE_PX}x{IMAGE_SIZE_PX}, batch {BATCH_SIZE}, "
        f"{config['timed_steps']} timed steps x {config['repeats']} repeats, {config['threads']} threads"
    )
    table = Table(title=title)
    for column in ("precision", "contender", "median samples/s", "ratio to hand loop", "min..max samples/s"):
        table.add_column(column, justify="left" if column in ("precision", "contender") else "right")
    for precision, by_name in results.items():
        for name, row in by_name.items():
            values = row["all_samples_per_s"]
            spread = f"{min(values):.2f}..{max(values):.2f}"
            table.add_row(precision, name, f"{row['samples_per_s']:.2f}", f"{row['ratio_to_hand_loop']:.3f}", spread)
    Console(width=120).print(table)


def describe_setup(args: argparse.Namespace, threads: int, timed_steps: int) -> dict[str, Any]:
    packages = ("torch", "torchvision", "accelerate", "lightning", "skylift")
    return {
        "model": MODEL_NAME, "image_size": IMAGE_SIZE_PX, "num_classes": NUM_CLASSES, "batch": BATCH_SIZE,
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY, "foreach": True},
        "grad_clip_norm": GRAD_CLIP_NORM, "seed": SEED, "warmup_steps": args.warmup_steps,
        "steps": timed_steps, "timed_steps": timed_steps, "repeats": args.repeats, "quick": args.quick,
        "order": "rotating", "threads": threads, "cpu": DeviceInfo.detect(torch.device("cpu")).name,
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "versions": {name: version(name) for name in packages},
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: few steps, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per precision (default 5, quick 2)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="untimed steps per run (default 3, quick 1)")
    parser.add_argument("--timed-steps", type=int, default=None, help="timed steps per run (default: from a probe)")
    parser.add_argument("--target-minutes", type=float, default=6.0, help="whole-benchmark time the plan aims at")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.warmup_steps = args.warmup_steps or (1 if args.quick else 3)
    args.timed_steps = args.timed_steps or (3 if args.quick else None)
    name = "trainer_overhead_quick.json" if args.quick else "trainer_overhead.json"
    args.output = args.output or RESULTS_DIR / name
    if args.repeats < 1 or args.warmup_steps < 1:
        parser.error("--repeats and --warmup-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started_s = time.perf_counter()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    precisions = ["fp32"]
    if DeviceInfo.detect(torch.device("cpu")).cpu_native_bf16:
        precisions.append("bf16")
    else:
        print("this CPU has no native bf16 (skylift refuses bf16 on it): measuring fp32 only")
    timed_steps = args.timed_steps
    probes: dict[str, dict[str, float]] = {}
    if timed_steps is None:
        probes = {precision: probe(precision, args.warmup_steps, threads) for precision in precisions}
        timed_steps = plan_timed_steps(probes, args, time.perf_counter() - started_s)
        print(f"probe {json.dumps(probes)} -> {timed_steps} timed steps per run")
    load_start = os.getloadavg()
    results = {precision: measure_precision(precision, args, timed_steps, threads) for precision in precisions}
    config = describe_setup(args, threads, timed_steps)
    config.update(
        probe=probes, load_average_1m_start=load_start[0], load_average_1m_end=os.getloadavg()[0],
        elapsed_s=round(time.perf_counter() - started_s, 1),
    )  # fmt: skip
    print_table(results, config)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    print(f"wrote {args.output} ({config['elapsed_s']} s)")
    return {"config": config, "results": results}


if __name__ == "__main__":
    main()

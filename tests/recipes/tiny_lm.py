"""Helpers for the causal-LM tests: a tiny Llama written by ``save_pretrained``, JSONL
documents whose labelled-token counts differ from block to block, and configs of the
CPU preset pointed at them."""

from __future__ import annotations

import json
from pathlib import Path

from skylift.config import load_config
from skylift.recipes.tiny_lm import write_corpus, write_tiny_lm

PRESET = "examples/causal-lm-cpu.yaml"

QUIET = ("monitor.tensorboard=false", "monitor.report=false", "monitor.progress_bar=false")
"""Nothing a test reads: TensorBoard files, the HTML report's PNGs, the progress bar."""

SGD_STEP = ("optim.name=sgd", "optim.lr=1.0", "optim.momentum=0.0", "optim.weight_decay=0.0",
            "optim.grad_clip_norm=null", "schedule.lr_schedule=constant", "schedule.warmup_steps=0",
            "precision=fp32", "deterministic=true")  # fmt: skip
"""One plain SGD step of lr 1 in fp32: the weights move by exactly minus the gradient."""


def write_model_folder(folder: Path) -> Path:
    """The tiny Llama (seed 0) and its tokenizer, as ``save_pretrained`` writes them."""
    return write_tiny_lm(folder, seed=0)


def uneven_rows(num_rows: int = 24) -> list[dict[str, str]]:
    """Prompt/completion documents of very different prompt lengths, and a few texts:
    packed blocks of these hold very different numbers of labelled tokens."""
    rows = []
    for index in range(num_rows):
        if index % 4 == 3:
            rows.append({"text": f"count from {index}: {index} {index + 1} {index + 2}"})
        else:
            filler = " ".join(["colour"] * (1 + 6 * (index % 3)))
            rows.append({"prompt": f"{filler} of a lemon:", "completion": " yellow" * (1 + index % 2)})
    return rows


def write_rows(path: Path, rows: list[dict[str, str]]) -> Path:
    return write_corpus(path, rows)


def lm_config(run_dir: Path, model: str, train: Path, *overrides: str, val: Path | None = None):
    """The CPU preset on ``model`` (a folder, or builtin:tiny-llama) and ``train``."""
    data = [f"recipe.model_path={model}", f"recipe.train_path={train}"]
    if val is not None:
        data.append(f"recipe.val_path={val}")
    return load_config(PRESET, [f"run_dir={run_dir}", *QUIET, *data, *overrides])


def run_args(run_dir: Path, *overrides: str) -> list[str]:
    """``skylift run`` of the CPU preset, lean (no doctor), JSON summary."""
    args = ["run", PRESET, "--json", "--no-doctor", "--set", f"run_dir={run_dir}"]
    for override in (*QUIET, *overrides):
        args += ["--set", override]
    return args


def train_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines) if record["kind"] == "train"}

"""DPO's reference log-probabilities computed at every step (TRL's default) against
precomputed once before the first step (``recipe.dpo.precompute_reference``).

examples/dpo-lora-cpu.yaml on the built-in tiny Llama, one thread, fp32: under LoRA (the
reference is the base with its adapters off) and as a full fine-tune (a frozen copy of
the starting model, which precomputing does not keep). Each run trains ``--steps`` steps
without checkpoints; the two ways alternate, ``--repeats`` rounds. Reported: the median
step time over each run's steps after the first five, the pass's own seconds (from its
log line) and the steps after which it has paid for itself.

    python -m benchmarks.dpo_reference [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "dpo_reference.json"
PRESET = "examples/dpo-lora-cpu.yaml"
TRAININGS = {"lora": (), "full": ("recipe.lora=null", "recipe.dpo.reference=null")}
PASS = re.compile(r"reference log-probabilities of (\d+) distinct pairs computed in ([0-9.]+) s")


def _run(folder: Path, training: str, precomputed: bool, steps: int) -> dict[str, Any]:
    overrides = [f"run_dir={folder}", "precision=fp32", f"schedule.max_steps={steps}", "schedule.warmup_steps=2",
                 "checkpoint.enabled=false", "monitor.log_every_steps=1", "monitor.tensorboard=false",
                 "monitor.report=false", "monitor.progress_bar=false", "data.eval_batch_size=64",
                 f"recipe.dpo.precompute_reference={str(precomputed).lower()}", *TRAININGS[training]]  # fmt: skip
    command = [sys.executable, "-m", "skylift", "run", PRESET, "--no-doctor"]
    for override in overrides:
        command += ["--set", override]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)  # fmt: skip
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    step_times = [record["step_time_s"] for record in records if record["kind"] == "train" and record["step"] > 5]
    found = PASS.search(done.stderr)
    return {"step_s": statistics.median(step_times), "wall_s": wall_s,
            "pass_s": float(found.group(2)) if found else None, "pairs": int(found.group(1)) if found else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for training in TRAININGS:
                for precomputed in (False, True):
                    name = f"{training}/{'precomputed' if precomputed else 'per_step'}"
                    result = _run(Path(scratch) / f"{training}-{precomputed}-{repeat}", training, precomputed,
                                  args.steps)  # fmt: skip
                    runs.setdefault(name, []).append(result)
                    print(f"{name} round {repeat + 1}: step {result['step_s'] * 1e3:.1f} ms, pass {result['pass_s']}",
                          flush=True)  # fmt: skip
    report: dict[str, Any] = {"steps": args.steps, "repeats": args.repeats, "trainings": {}}
    for training in TRAININGS:
        per_step, precomputed = runs[f"{training}/per_step"], runs[f"{training}/precomputed"]
        step_per_step = statistics.median(run["step_s"] for run in per_step)
        step_precomputed = statistics.median(run["step_s"] for run in precomputed)
        pass_s = statistics.median(run["pass_s"] for run in precomputed)
        saved = step_per_step - step_precomputed
        report["trainings"][training] = {
            "step_ms_per_step_reference": round(step_per_step * 1e3, 2),
            "step_ms_precomputed": round(step_precomputed * 1e3, 2),
            "step_time_ratio": round(step_precomputed / step_per_step, 3),
            "pass_s": round(pass_s, 2),
            "distinct_pairs": precomputed[0]["pairs"],
            "paid_for_after_steps": round(pass_s / saved) if saved > 0 else None,
        }
        print(f"{training}: {report['trainings'][training]}", flush=True)
    report["machine"] = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

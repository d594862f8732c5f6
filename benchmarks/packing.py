"""Packed vs padded causal-LM training on the CPU: tokens/s and padding share, side by side.

Both arms train the built-in tiny Llama (2 layers, 0.15 M parameters, fp32, sdpa
attention) through the ``causal_lm`` recipe's own datasets, collation and loss, on the
same documents: the project's generated chat corpus (``examples/data/tiny-chat.jsonl``,
1,200 conversations rendered by the tiny tokenizer's chat template: 20-159 tokens,
quartiles 49 / 70 / 91, only the assistant turns learned). Its lengths are the
distribution measured; they come from the corpus generator (``skylift.recipes.tiny_lm``),
not from a published dataset, and vary less than real chat data (UltraChat's or
ShareGPT's span three orders of magnitude), so the padding saved here is a low estimate.

- ``padded``: ``recipe.packing: false``, one document a sequence, ``PADDED_BATCH``
  documents a step in the sampler's shuffled order, padded to the batch's longest.
- ``packed``: ``recipe.packing: true``, documents placed by best-fit decreasing into
  sequences of up to ``SEQUENCE_LENGTH`` tokens, each attending only to itself
  (transformers' block-diagonal mask from per-document position ids), ``PACKED_BATCH``
  sequences a step (about as many documents a step as the padded arm).

Each arm runs ``warmup_steps`` untimed steps (forward, backward, AdamW) and times
``timed_steps`` more, on one thread; the arms alternate for ``repeats`` rounds. Reported
per arm: the padding share of the timed batches' positions, real (non-pad) tokens/s,
labelled tokens/s, documents/s, positions/s (padding included: the cost of a position,
which the packed arm's longer sequences and materialised block-diagonal mask raise) and
the CPU share (below 1: the machine was shared); packed / padded ratios of the medians,
and the median of the per-round ratios of tokens/s.
``python -m benchmarks.packing [--quick]`` writes ``benchmarks/results/packing.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import environment, write_report
from skylift.config.load import load_config
from skylift.data.jsonl_text import IGNORE_INDEX
from skylift.recipes.causal_lm import CausalLM

ARMS = ("padded", "packed")
SEQUENCE_LENGTH = 256
PADDED_BATCH = 16
PACKED_BATCH = 4  # x 256 positions: about 15 documents of this corpus, as the padded arm's 16
CORPUS = Path("examples/data/tiny-chat.jsonl")
PRESET = "examples/causal-lm-cpu.yaml"
THREADS = 1
RESULTS = Path(__file__).parent / "results" / "packing.json"


def _recipe(arm: str, run_dir: Path) -> CausalLM:
    overrides = [f"run_dir={run_dir}", f"recipe.train_path={CORPUS}", f"recipe.sequence_length={SEQUENCE_LENGTH}",
                 f"recipe.packing={'true' if arm == 'packed' else 'false'}", "data.val_fraction=0.05",
                 "precision=fp32"]  # fmt: skip
    return CausalLM(load_config(PRESET, overrides))


def _batches(recipe: CausalLM, dataset: Any, batch_size: int, count: int) -> list[Any]:
    """``count`` batches in a seeded shuffled order (the sampler's kind of order)."""
    collate = recipe.collate(train=True)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    order = (order * (1 + count * batch_size // len(order)))[: count * batch_size]
    return [collate([dataset[index] for index in order[start : start + batch_size]])
            for start in range(0, len(order), batch_size)]  # fmt: skip


def _shape(batch: Any) -> tuple[int, int, int, int]:
    """(positions, real tokens, labelled tokens, documents) of one batch."""
    if isinstance(batch, dict):  # packed: the real positions are the documents', counted by _packed_batches
        labels = batch["labels"]
        return labels.numel(), int(batch["real"].sum()), int((labels != IGNORE_INDEX).sum()), int(batch["documents"])
    input_ids, attention_mask, labels = batch
    return input_ids.numel(), int(attention_mask.sum()), int((labels != IGNORE_INDEX).sum()), len(input_ids)


def _packed_batches(recipe: CausalLM, dataset: Any, count: int) -> list[Any]:
    collate = recipe.collate(train=True)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    order = (order * (1 + count * PACKED_BATCH // len(order)))[: count * PACKED_BATCH]
    batches = []
    for start in range(0, len(order), PACKED_BATCH):
        chosen = order[start : start + PACKED_BATCH]
        batch = collate([dataset[index] for index in chosen])
        # Bookkeeping for the counts only; the forward reads input_ids, position_ids, labels.
        batch["real"] = torch.tensor([dataset.lengths[index] for index in chosen])
        batch["documents"] = torch.tensor(sum(len(dataset.document_lengths[index]) for index in chosen))
        batches.append(batch)
    return batches


def run_arm(arm: str, warmup_steps: int, timed_steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run_dir:
        recipe = _recipe(arm, Path(run_dir))
        data = recipe.build_datasets()
        model = recipe.build_model(data).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        steps = warmup_steps + timed_steps
        batches = (_packed_batches(recipe, data.train, steps) if arm == "packed"
                   else _batches(recipe, data.train, PADDED_BATCH, steps))  # fmt: skip
        totals = [0, 0, 0, 0]
        started = started_cpu = 0.0
        for step, batch in enumerate(batches):
            if step == warmup_steps:
                started, started_cpu = time.perf_counter(), time.process_time()
            loss = recipe.training_loss(model, {key: batch[key] for key in ("input_ids", "position_ids", "labels")}
                                        if isinstance(batch, dict) else batch)  # fmt: skip
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup_steps:
                totals = [total + part for total, part in zip(totals, _shape(batch), strict=True)]
        elapsed_s = time.perf_counter() - started
        cpu_s = time.process_time() - started_cpu
    positions, real, labelled, documents = totals
    return {"padding_share": 1 - real / positions, "tokens_per_s": real / elapsed_s,
            "labelled_tokens_per_s": labelled / elapsed_s, "documents_per_s": documents / elapsed_s,
            "positions_per_s": positions / elapsed_s, "elapsed_s": elapsed_s,
            # CPU time over wall time on THREADS threads: well below 1, other processes took the core.
            "cpu_share": cpu_s / (elapsed_s * THREADS),
            "documents_per_step": documents / timed_steps, "positions_per_step": positions / timed_steps}  # fmt: skip


def _print(config: dict[str, Any], results: dict[str, Any]) -> None:
    print(f"packing benchmark: {config['corpus']}, sequence_length {SEQUENCE_LENGTH}, {config['threads']} thread")
    keys = ("padding_share", "tokens_per_s", "labelled_tokens_per_s", "documents_per_s", "documents_per_step")
    print(f"{'arm':8}" + "".join(f"{key:>24}" for key in keys))
    for arm in ARMS:
        print(f"{arm:8}" + "".join(f"{results['median'][arm][key]:>24.4g}" for key in keys))
    ratios = results["ratios"]
    print("packed / padded: " + ", ".join(f"{key} x{value:.3g}" for key, value in ratios.items()
                                          if key != "padding_share_points_saved")
          + f"; padding share {ratios['padding_share_points_saved']:.1%} points lower")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps, one round (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    warmup_steps, timed_steps, repeats = (1, 3, 1) if args.quick else (3, 20, 5)
    torch.set_num_threads(THREADS)
    started_s = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for round_index in range(repeats):
        for arm in ARMS if round_index % 2 == 0 else reversed(ARMS):
            runs[arm].append(run_arm(arm, warmup_steps, timed_steps))
    median = {arm: {key: statistics.median(run[key] for run in runs[arm]) for key in runs[arm][0]} for arm in ARMS}
    ratios = {key: median["packed"][key] / median["padded"][key]
              for key in ("tokens_per_s", "labelled_tokens_per_s", "documents_per_s")}  # fmt: skip
    ratios["padding_share_points_saved"] = median["padded"]["padding_share"] - median["packed"]["padding_share"]
    # Per round (the two arms ran back to back, under the same load), then their median.
    ratios["tokens_per_s_paired_median"] = statistics.median(
        packed["tokens_per_s"] / padded["tokens_per_s"] for packed, padded in zip(runs["packed"], runs["padded"], strict=True))
    ratios["positions_per_s"] = median["packed"]["positions_per_s"] / median["padded"]["positions_per_s"]
    config = {"corpus": str(CORPUS), "model": "builtin:tiny-llama (fp32, sdpa)", "sequence_length": SEQUENCE_LENGTH,
              "padded_batch_documents": PADDED_BATCH, "packed_batch_sequences": PACKED_BATCH,
              "warmup_steps": warmup_steps, "timed_steps": timed_steps, "repeats": repeats,
              **environment(THREADS, ("torch", "transformers"))}  # fmt: skip
    write_report(args.out, config, {"median": median, "ratios": ratios, "runs": runs}, started_s, _print)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

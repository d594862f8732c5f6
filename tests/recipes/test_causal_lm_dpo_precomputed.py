"""DPO's reference log-probabilities precomputed once (``recipe.dpo.precompute_reference``):
a pair's key ignores its batch's padding, the table holds what the per-step reference
forward computes (to fp32's rounding), it is stored at the checkpoint root without
pickle, and a run killed mid-way resumes exactly, reading the stored table or, where it
is gone, computing it again from the model as built.

The runs are examples/dpo-lora-cpu.yaml shortened, as in test_causal_lm_dpo.py; the
full fine-tune's reference (``frozen_copy``) is the case that saves memory: no copy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from safetensors.torch import load_file

from skylift.checkpoint.manifest import committed_steps
from skylift.recipes.causal_lm import CausalLM
from skylift.recipes.reference_table import ReferenceTable, pair_keys
from skylift.storage import open_store
from skylift.train.reference_pass import REFERENCE_FOLDER
from tests.checkpoint.runs import ONE_THREAD, losses_by_step, run_here, summary
from tests.conftest import run_cli
from tests.recipes.test_causal_lm_dpo import KILLED_AT, STEPS, _args, _config, _log_prob_bound, _train_records

PRECOMPUTED = "recipe.dpo.precompute_reference=true"
FULL = ("recipe.lora=null", "recipe.dpo.reference=null")
"""A full fine-tune: the reference is the starting model, which precomputing keeps no copy of."""


def _recipe_and_pairs(tmp_path: Path, *overrides: str):
    recipe = CausalLM(_config(tmp_path / "run", "precision=fp32", *overrides))
    data = recipe.build_datasets()
    return recipe, data, recipe.build_model(data).eval()


def test_a_pairs_key_is_its_tokens_whatever_the_batch_pads_it_to(tmp_path):
    recipe, data, _ = _recipe_and_pairs(tmp_path)
    collate = recipe.collate(train=False)
    pairs = [data.train[index] for index in range(12)]
    alone = [pair_keys(collate([pair]))[0] for pair in pairs]
    longest_first = sorted(range(12), key=lambda index: -len(pairs[index][0]))
    together = pair_keys(collate([pairs[index] for index in longest_first]))
    assert together == [alone[index] for index in longest_first]  # padded to the longest: the same keys
    distinct = {tuple(map(tuple, (tensor.tolist() for tensor in pair))) for pair in pairs}
    assert len(set(alone)) == len(distinct)  # two pairs share a key only when their tokens are the same


def test_the_table_is_what_the_reference_forward_computes_and_the_policy_is_not_read_after(tmp_path):
    """Computed in batches of 64 pairs, looked up for a training batch of 16 grouped
    otherwise: each value equals the per-step reference forward on that batch to within
    two fp32 computations' bound. Once the table is in place the policy (which trains
    away from the starting model) is never read as the reference again."""
    recipe, data, model = _recipe_and_pairs(tmp_path, *FULL, PRECOMPUTED)
    assert recipe.frozen_reference() is None
    evaluation = recipe.collate(train=False)
    table = ReferenceTable("test")
    for start in range(0, len(data.train), 64):
        table.add(*recipe.reference_log_probs(model, evaluation([data.train[index]
                                                                 for index in range(start, min(start + 64,
                                                                                               len(data.train)))])))
    batch = recipe.collate(train=True)([data.train[index] for index in range(5, len(data.train), 33)])
    input_ids, attention_mask, labels = (tensor.transpose(0, 1).flatten(0, 1) for tensor in batch)
    with torch.no_grad():
        per_step = recipe.reference.log_probs(model, input_ids, attention_mask, labels)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    looked_up = table.lookup(batch)
    bound = _log_prob_bound(logits, labels)
    assert bool(((looked_up - per_step).abs() <= bound.float()).all()), (looked_up - per_step).abs().max()
    recipe.use_reference_table(table)
    with pytest.raises(RuntimeError, match="policy has moved"):
        recipe.reference.log_probs(model, input_ids, attention_mask, labels)
    assert torch.equal(recipe._dpo_forward(model, batch)[0], recipe._dpo_forward(model, batch)[0])


def test_the_table_reads_back_and_a_table_of_another_fingerprint_is_not_used(tmp_path):
    recipe, data, model = _recipe_and_pairs(tmp_path)
    table = ReferenceTable("one")
    table.add(*recipe.reference_log_probs(model, recipe.collate(train=False)([data.train[i] for i in range(8)])))
    stored = table.to_bytes()
    assert ReferenceTable.from_bytes(stored, "another") is None
    again = ReferenceTable.from_bytes(stored, "one")
    assert again is not None and again.values == table.values


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A full fine-tune's uninterrupted DPO run with the reference precomputed, in this process."""
    run_dir = tmp_path_factory.mktemp("dpo-precomputed") / "run"
    result = run_here(*_args(run_dir, *FULL, PRECOMPUTED))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stderr


def test_a_run_stores_its_table_at_the_root_and_trains_as_the_per_step_reference(uninterrupted, tmp_path):
    """The table is a safetensors file under checkpoint.root's reference/ holding every
    distinct pair of the set; the first step's loss is log 2 and its margin 0 (policy =
    reference, to the values' rounding), as with the reference computed at every step."""
    run_dir, log = uninterrupted
    [stored] = (run_dir / "checkpoints" / REFERENCE_FOLDER).glob("*.safetensors")
    tensors = load_file(stored)
    assert tensors["keys"].shape[1] == 16 and tensors["log_probs"].shape == (len(tensors["keys"]), 2)
    assert f"{len(tensors['keys'])} distinct pairs computed in" in log and "frozen reference copy" not in log
    per_step = tmp_path / "per-step"
    result = run_here(*_args(per_step, *FULL, "schedule.max_steps=1", "schedule.warmup_steps=0", "checkpoint.enabled=false"))
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs = _train_records(run_dir)[1], _train_records(per_step)[1]
    assert ours["loss"] == pytest.approx(math.log(2), abs=1e-6) and theirs["loss"] == pytest.approx(math.log(2),
                                                                                                    abs=1e-6)
    assert ours["rewards/margins"] == pytest.approx(theirs["rewards/margins"], abs=1e-6)
    records = _train_records(run_dir)
    assert sorted(records) == list(range(1, STEPS + 1)) and all(math.isfinite(r["loss"]) for r in records.values())


@pytest.mark.slow
@pytest.mark.parametrize("table", ["stored", "gone"])
def test_a_killed_run_resumes_exactly_reading_or_recomputing_the_table(uninterrupted, tmp_path, table):
    """SIGKILL right after step 8's manifest, then the same command: the resume reads the
    stored table, or (the table deleted) computes it again from the model as built before
    the checkpoint loads; either way every step's loss and rewards and the final weights
    equal the uninterrupted run's, bit for bit."""
    reference_dir, _ = uninterrupted
    run_dir = tmp_path / "run"
    killed = run_cli(*_args(run_dir, *FULL, PRECOMPUTED),
                     env={**ONE_THREAD, "SKYLIFT_FAULT_INJECTION": f"after_manifest:step={KILLED_AT}"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == KILLED_AT
    if table == "gone":
        for stored in (run_dir / "checkpoints" / REFERENCE_FOLDER).glob("*"):
            stored.unlink()
    resumed = run_here(*_args(run_dir, *FULL, PRECOMPUTED))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("distinct pairs read from" if table == "stored" else "distinct pairs computed in") in resumed.stderr
    assert summary(run_dir)["resumed_from_step"] == KILLED_AT
    assert losses_by_step(run_dir) == losses_by_step(reference_dir)
    ours, theirs = _train_records(run_dir), _train_records(reference_dir)
    assert all(ours[step]["rewards/margins"] == theirs[step]["rewards/margins"] for step in theirs)
    final, want = load_file(run_dir / "model.safetensors"), load_file(reference_dir / "model.safetensors")
    assert final.keys() == want.keys() and all(torch.equal(final[name], want[name]) for name in want)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(line)["kind"] == "eval" for line in lines)

"""DPO's reference in the memory model: a frozen copy of the starting model is counted as
every weight once more (and doctor says so); with adapters the reference is the base with
the adapters off, which costs no memory."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from skylift.config import load_config
from skylift.doctor.memory import estimate_memory
from skylift.doctor.rules.resources import _memory_parts
from skylift.recipes.causal_lm import CausalLM

PRESET = "examples/dpo-lora-cpu.yaml"
WITHOUT_ADAPTERS = ("recipe.lora=null", "recipe.dpo.reference=null")


def test_a_frozen_copy_counts_the_bytes_the_real_copy_holds(tmp_path):
    config = load_config(PRESET, [f"run_dir={tmp_path}", *WITHOUT_ADAPTERS])
    estimate = estimate_memory(config, 8, 1)
    recipe = CausalLM(config)
    recipe.build_model(recipe.build_datasets())
    copy = recipe.reference.copy
    assert copy is not None
    held = sum(parameter.numel() * parameter.element_size() for parameter in copy.parameters())
    assert estimate.reference_bytes == held > 0
    without = estimate_memory(load_config(PRESET, [f"run_dir={tmp_path}", "recipe.lora=null", "recipe.objective=sft",
                                                   "recipe.dpo=null"]), 8, 1)  # fmt: skip
    assert estimate.total_bytes - without.total_bytes == held
    assert "DPO reference copy" in _memory_parts(estimate)


def test_the_base_without_adapters_costs_nothing(tmp_path):
    estimate = estimate_memory(load_config(PRESET, [f"run_dir={tmp_path}"]), 8, 1)
    assert estimate.adapters is not None and estimate.reference_bytes == 0
    assert "DPO reference" not in _memory_parts(estimate)


def test_the_plan_says_it_counted_the_reference_copy(tmp_path):
    from skylift.doctor.memory import trace_model_memory
    from skylift.plan.planning import _memory_assumption

    memory = trace_model_memory(load_config(PRESET, [f"run_dir={tmp_path}", *WITHOUT_ADAPTERS]), 8)
    assert "DPO's frozen reference copy of the weights (591 KiB)" in _memory_assumption(memory, None)


def test_under_fsdp_each_rank_holds_its_shard_of_the_frozen_copy(tmp_path):
    whole = estimate_memory(load_config(PRESET, [f"run_dir={tmp_path}", *WITHOUT_ADAPTERS]), 8, 2)
    sharded = estimate_memory(load_config(PRESET, [f"run_dir={tmp_path}", *WITHOUT_ADAPTERS,
                                                   "distributed.strategy=fsdp"]), 8, 2)  # fmt: skip
    assert sharded.reference_bytes == whole.reference_bytes // 2 > 0


def test_a_precomputed_reference_holds_no_copy_and_counts_none(tmp_path):
    """``recipe.dpo.precompute_reference``: the recipe takes no copy, and the estimate is
    the SFT run's (the table of log-probabilities is 24 bytes a distinct pair, on the host)."""
    config = load_config(PRESET, [f"run_dir={tmp_path}", *WITHOUT_ADAPTERS, "recipe.dpo.precompute_reference=true"])
    recipe = CausalLM(config)
    recipe.build_model(recipe.build_datasets())
    assert recipe.reference.copy is None and recipe.frozen_reference() is None
    estimate = estimate_memory(config, 8, 1)
    without = estimate_memory(load_config(PRESET, [f"run_dir={tmp_path}", "recipe.lora=null", "recipe.objective=sft",
                                                   "recipe.dpo=null"]), 8, 1)  # fmt: skip
    assert estimate.reference_bytes == 0 and estimate.total_bytes == without.total_bytes
    assert "DPO reference" not in _memory_parts(estimate)

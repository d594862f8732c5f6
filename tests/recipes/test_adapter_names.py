"""A LoRA model's tensors under the base's own names (what a sharded run loads from the
model folder), and adapters drawn from the run's seed whatever the global random state."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from skylift.recipes.adapters import apply_lora, base_weight_name
from skylift.recipes.settings.causal_lm import LoraSettings
from skylift.recipes.tiny_lm import tiny_llama, tiny_tokenizer
from skylift.train.shard_loading import _persistent_tensors

LORA = LoraSettings(rank=4, modules_to_save=["lm_head"])


def test_every_base_tensor_maps_to_the_base_models_name_and_adapters_to_none():
    tokenizer = tiny_tokenizer()
    base = tiny_llama(tokenizer, seed=0)
    base_names = set(base.state_dict())
    adapted = apply_lora(tiny_llama(tokenizer, seed=0), LORA, seed=0)
    mapped = {name: base_weight_name(name) for name, _ in _persistent_tensors(adapted)}
    adapters = {name for name, target in mapped.items() if target is None}
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert {target for target in mapped.values() if target is not None} == base_names
    assert mapped["base_model.model.lm_head.modules_to_save.default.weight"] == "lm_head.weight"
    assert mapped["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == (
        "model.layers.0.self_attn.q_proj.weight")


def test_the_adapters_are_the_seeds_whatever_the_global_random_state_was():
    tokenizer = tiny_tokenizer()
    torch.manual_seed(1)
    first = apply_lora(tiny_llama(tokenizer, seed=0), LORA, seed=5)
    torch.manual_seed(2)
    torch.rand(1000)  # the global state elsewhere, as a base's construction may leave it
    second = apply_lora(tiny_llama(tokenizer, seed=0), LORA, seed=5)
    other = apply_lora(tiny_llama(tokenizer, seed=0), LORA, seed=6)
    ours, theirs, different = first.state_dict(), second.state_dict(), other.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    lora_a = [name for name in ours if ".lora_A." in name]
    assert lora_a and not any(torch.equal(ours[name], different[name]) for name in lora_a)
    assert all(not ours[name].any() for name in ours if ".lora_B." in name)  # B at zero: output unchanged

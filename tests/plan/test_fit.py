"""One memory model for ``skylift doctor`` and ``skylift plan``: the same bytes, the same fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from skylift.config.load import load_config
from skylift.doctor.memory import _saved_tensors, estimate_memory, trace_model_memory
from skylift.doctor.rules.resources import memory_fits_device
from skylift.machine.facts import Facts, GpuFacts, JobFacts, TorchFacts
from skylift.machine.memory import ModelMemory, optimizer_state_copies, training_memory
from skylift.plan.model import Target, predict_step
from tests.plan.test_model import measurement

REPO_ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
# The guide's 8-GPU ResNet-50 (SGD, momentum 0.875) on synthetic images of its size: its
# ImageNet shards are streamed, and a streamed image's shape is known only from a shard.
RESNET50_8GPU = ["data.url=null", "data.val_url=null", "recipe.dataset=synthetic_images", "recipe.num_classes=1000",
                 "precision=bf16"]


def _gpu_target(memory_gib: float, ranks: int = 8) -> Target:
    return Target(name=f"{ranks}x{memory_gib:g}", device="cuda", ranks_per_node=ranks, peak_flops_per_s=3e14,
                  memory_bandwidth_bytes_per_s=2e12, vcpus_per_rank=8, device_memory_bytes=memory_gib * GIB)


def _doctor_status(config, memory_gib: float) -> tuple[str, int]:
    estimate = estimate_memory(config, 128, 8)
    gpu = GpuFacts(index=0, name="NVIDIA A100", memory_total_bytes=int(memory_gib * GIB))
    facts = Facts(torch=TorchFacts(cuda_available=True), gpus=[gpu],
                  job=JobFacts(device="cuda", nproc=8, micro_batch_size=128, memory=estimate))
    return memory_fits_device(facts).status, estimate.total_bytes


def test_doctor_and_plan_answer_the_resnet50_preset_with_the_same_bytes_and_fit():
    config = load_config(REPO_ROOT / "examples" / "resnet50-imagenet-8gpu.yaml", RESNET50_8GPU)
    assert config.optim.name == "sgd" and config.data.global_batch_size == 1024
    memory = trace_model_memory(config, 128)
    assert memory.optimizer_state_copies == 1
    m = measurement(device="cuda", device_name="NVIDIA A100", configured_precision="bf16", precision="bf16",
                    global_batch_size=1024, micro_batch_size=128, world_size=8)
    for memory_gib, fits in ((80, True), (5, False)):  # about 5.6 GiB per rank at 128 images in bf16
        status, doctor_bytes = _doctor_status(config, memory_gib)
        prediction = predict_step(m, _gpu_target(memory_gib), memory=memory)
        plan_fits = prediction.dropped is None and prediction.accumulation_steps == 1
        assert (status == "pass", plan_fits) == (fits, fits), memory_gib
    at_128 = predict_step(m, _gpu_target(80), memory=memory).memory
    assert at_128.total_bytes == doctor_bytes
    assert at_128.bucket_bytes == at_128.gradient_bytes == memory.trainable_parameters * 4  # DDP over 8 GPUs


def test_sgd_with_momentum_keeps_one_state_copy_adamw_two_and_plain_sgd_none():
    assert optimizer_state_copies("sgd", 0.9) == 1
    assert optimizer_state_copies("adamw", 0.9) == 2
    assert optimizer_state_copies("sgd", 0.0) == 0
    base = ["recipe.dataset=synthetic_images", "recipe.model=resnet18", "recipe.image_size=32"]
    adamw = estimate_memory(load_config(None, [*base, "optim.name=adamw"]), 8, 1)
    sgd = estimate_memory(load_config(None, [*base, "optim.name=sgd", "optim.momentum=0.9"]), 8, 1)
    assert adamw.optimizer_bytes == 2 * sgd.optimizer_bytes == 2 * sgd.parameter_bytes
    with pytest.raises(ValueError, match="optim.name"):
        optimizer_state_copies("lamb", 0.9)


def test_a_job_that_fits_under_sgd_but_not_adamw_is_dropped_only_under_adamw():
    # 1 GiB of weights, 0.25 GiB of activations for its one sample: SGD 3.25 GiB, AdamW 4.25 GiB,
    # against 90% of 4.5 GiB = 4.05 GiB.
    def model(copies: int) -> ModelMemory:
        return ModelMemory(parameters=2**28, trainable_parameters=2**28, optimizer_state_copies=copies,
                           saved_float_elements_per_sample=2**26)

    m = measurement(device="cuda", device_name="NVIDIA A100", global_batch_size=1, micro_batch_size=1)
    sgd = predict_step(m, _gpu_target(4.5, ranks=1), memory=model(1))
    adamw = predict_step(m, _gpu_target(4.5, ranks=1), memory=model(2))
    assert sgd.dropped is None and sgd.memory.total_bytes == 3.25 * GIB
    assert adamw.dropped.startswith("does not fit")
    assert training_memory(model(1), 1, half_precision=False, world_size=1).fits(4.5 * GIB)
    assert not training_memory(model(2), 1, half_precision=False, world_size=1).fits(4.5 * GIB)


def test_activations_are_the_tensors_saved_for_backward_counted_by_hand():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        inputs, labels = torch.empty(16, 4), torch.zeros(16, dtype=torch.long)
    # The first Linear saves its input (16 x 4); ReLU's output (16 x 8) is saved once, by
    # ReLU and the second Linear; the weights are parameters, counted apart.
    assert _saved_tensors(model, inputs, lambda net, batch: net(batch).sum()) == ((16 * 4 + 16 * 8, 0), None)
    # Cross-entropy adds log-softmax's output (16 x 2), its total weight (1) and the int64 labels.
    loss = lambda net, batch: nn.functional.cross_entropy(net(batch[0]), batch[1])  # noqa: E731
    assert _saved_tensors(model, (inputs, labels), loss) == ((16 * 4 + 16 * 8 + 16 * 2 + 1, 16 * 8), None)


def test_precision_ema_and_ranks_change_the_breakdown_as_documented():
    model = ModelMemory(parameters=1000, trainable_parameters=800, buffer_elements=50, optimizer_state_copies=2,
                        ema=True, saved_float_elements_per_sample=10.0, saved_other_bytes_per_sample=8.0)
    full = training_memory(model, 4, half_precision=False, world_size=1)
    assert (full.parameter_bytes, full.gradient_bytes, full.optimizer_state_bytes) == (4000, 3200, 6400)
    assert (full.bucket_bytes, full.ema_bytes, full.autocast_weight_bytes, full.activation_bytes) == (0, 4200, 0, 192)
    half = training_memory(model, 4, half_precision=True, world_size=2)
    assert (half.bucket_bytes, half.autocast_weight_bytes, half.activation_bytes) == (3200, 2000, 112)
    sharded = training_memory(model, 4, half_precision=False, world_size=4, shard_count=4)
    assert (sharded.parameter_bytes, sharded.optimizer_state_bytes, sharded.bucket_bytes) == (1000, 1600, 0)

"""FLOP counting on the meta device, GPU peaks, the measured CPU peak."""

from __future__ import annotations

import torch
from torch import nn

from skylift.monitor.flops import count_step_flops, gpu_peak, measure_cpu_peak_flops


def _loss(model, batch):
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs), targets)


def test_counts_forward_and_backward_matmuls():
    batch_size, features, hidden, classes = 16, 32, 64, 10
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    batch = (torch.randn(batch_size, features), torch.zeros(batch_size, dtype=torch.long))
    flops = count_step_flops(model, batch, _loss)
    forward = 2 * batch_size * (features * hidden + hidden * classes)
    # backward: weight gradients of both layers, input gradient of the second only
    backward = 2 * batch_size * (features * hidden + hidden * classes) + 2 * batch_size * hidden * classes
    assert flops == forward + backward


def test_counting_touches_neither_model_nor_random_state():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 2))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    batch = (torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    torch.manual_seed(3)
    expected_draw = torch.rand(4)
    torch.manual_seed(3)
    count_step_flops(model, batch, _loss)
    assert torch.equal(torch.rand(4), expected_draw)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


def test_gpu_peaks_by_name_and_precision():
    assert gpu_peak("NVIDIA H200", "bf16").flops_per_s == 989e12
    assert gpu_peak("NVIDIA H100 PCIe", "bf16").flops_per_s == 756e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "tf32").flops_per_s == 156e12
    assert gpu_peak("NVIDIA A10G", "fp16").source == "table:a10g-24gb"
    assert gpu_peak("Tesla T4", "fp32").flops_per_s == 8.1e12
    unknown = gpu_peak("Some Future GPU", "bf16")
    assert unknown.flops_per_s is None and unknown.source.startswith("unknown")


def test_cpu_peak_is_measured():
    assert measure_cpu_peak_flops(torch.float32, size=256, budget_s=0.05) > 1e8

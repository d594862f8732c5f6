"""FLOP counting on the meta device, GPU peaks, the measured CPU peak."""

from __future__ import annotations

import json

import torch
from torch import nn

from skylift.monitor.flops import count_step_flops, gpu_peak


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


def test_a_small_models_mfu_on_a_large_gpu_is_written_with_its_significant_digits(tmp_path):
    """The quickstart's MLP on an H200 (989 TFLOP/s dense bf16) runs at an MFU near 1e-6:
    a record must carry that figure, not 0 (found on the GPU: five decimals wrote 0.0)."""
    import time

    import torch

    from skylift.loop.events import TrainState
    from skylift.monitor.metrics import MetricsLogger
    from skylift.run_dir import RunDirectory

    run_dir = RunDirectory(tmp_path)
    run_dir.create()
    metrics = MetricsLogger(run_dir, log_every_steps=2, tensorboard=False, is_writer=True)
    peak_flops_per_s = 989e12
    metrics.set_flops(flops_per_sample=1e5, peak_flops_per_s=peak_flops_per_s)
    state = TrainState(total_steps=2, steps_per_epoch=2, global_batch_size=64)
    metrics.on_fit_start(state)
    started = time.perf_counter()
    for step in (1, 2):
        time.sleep(0.01)
        state.step, state.samples_seen, state.loss = step, 64 * step, torch.tensor(1.0)
        metrics.on_step_end(state)
    elapsed_s = time.perf_counter() - started
    metrics.on_fit_end(state)
    train = [json.loads(line) for line in run_dir.metrics_path.read_text().splitlines()]
    upper = 1e5 * 128 / (0.02 * peak_flops_per_s)  # the interval took at least the two sleeps
    lower = 1e5 * 128 / ((elapsed_s + 1.0) * peak_flops_per_s)  # and at most a second more than measured here
    assert all(lower <= record["mfu"] <= upper for record in train), [record["mfu"] for record in train]

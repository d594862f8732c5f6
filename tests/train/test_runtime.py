from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from skylift.loop.distributed import DistributedContext
from skylift.train.runtime import Runtime

CPU = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(samples: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with labels from a fixed linear teacher, so the task is learnable."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 16, generator=generator)
    teacher = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))
    return inputs, (inputs @ teacher).argmax(dim=1)


def _train(model, inputs, targets, *, accumulation_steps, micro_batch, steps, clip=None, precision="fp32", lr=0.1):
    runtime = Runtime(precision=precision, accumulation_steps=accumulation_steps, grad_clip_norm=clip, context=CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, optimizer = runtime.prepare(model, optimizer)
    losses = []
    per_step = accumulation_steps * micro_batch
    for step in range(steps):
        for micro in range(accumulation_steps):
            begin = step * per_step + micro * micro_batch
            with runtime.autocast():
                loss = nn.functional.cross_entropy(model(inputs[begin : begin + micro_batch]), targets[begin : begin + micro_batch])
            runtime.backward(loss)
            stepped = runtime.optimizer_step()
            assert stepped == (micro == accumulation_steps - 1)
        losses.append(loss.item())
    return model, runtime, losses


def _max_relative_difference(first: nn.Module, second: nn.Module) -> float:
    worst = 0.0
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item())
    return worst


@pytest.mark.parametrize("accumulation_steps", [2, 4])
def test_accumulation_equals_one_large_batch(accumulation_steps):
    inputs, targets = _data()
    big, _, _ = _train(_model(), inputs, targets, accumulation_steps=1, micro_batch=16, steps=4, clip=1.0)
    accumulated, _, _ = _train(
        _model(), inputs, targets, accumulation_steps=accumulation_steps, micro_batch=16 // accumulation_steps,
        steps=4, clip=1.0,
    )
    assert _max_relative_difference(accumulated, big) <= 1e-6


def test_accumulated_gradients_match_before_the_step():
    inputs, targets = _data(16)
    reference = _model()
    nn.functional.cross_entropy(reference(inputs), targets).backward()
    model = _model()
    runtime = Runtime(precision="fp32", accumulation_steps=4, context=CPU)
    model = runtime.prepare(model)
    for micro in range(4):
        with runtime.autocast():
            loss = nn.functional.cross_entropy(model(inputs[micro * 4 : micro * 4 + 4]), targets[micro * 4 : micro * 4 + 4])
        runtime.backward(loss)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)


def test_clipping_bounds_the_gradient_norm():
    inputs, targets = _data(8)
    model = _model()
    runtime = Runtime(precision="fp32", grad_clip_norm=0.01, context=CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = runtime.prepare(model, optimizer)
    with runtime.autocast():
        loss = nn.functional.cross_entropy(model(inputs), targets)
    runtime.backward(loss)
    grads_before_step = None

    def capture(*_args, **_kwargs):
        nonlocal grads_before_step
        grads_before_step = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()

    optimizer.register_step_pre_hook(capture)
    runtime.optimizer_step()
    assert runtime.last_grad_norm.item() > 0.01
    assert grads_before_step == pytest.approx(0.01, rel=1e-3)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cpu(precision):
    """bf16 where PyTorch's kernels for this CPU have it natively (AVX512-BF16, AMX); on other
    CPUs, or under ATEN_CPU_CAPABILITY=avx2/default, asking for it is refused with the fix."""
    from skylift.errors import SkyliftConfigError
    from skylift.train.precision import DeviceInfo

    if precision == "bf16" and not DeviceInfo.detect(torch.device("cpu")).cpu_native_bf16:
        with pytest.raises(SkyliftConfigError, match="precision: fp32 or precision: auto"):
            Runtime(precision="bf16", context=CPU)
        return
    inputs, targets = _data(256)
    model, runtime, losses = _train(
        _model(), inputs, targets, accumulation_steps=2, micro_batch=8, steps=16, clip=1.0, precision=precision, lr=0.05
    )
    assert runtime.precision.name == precision
    assert (runtime.scaler is not None) == (precision == "fp16")
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_unscales_before_clipping():
    """The reported norm is of true gradients, not of gradients times the loss scale."""
    inputs, targets = _data(8)
    model = _model()
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(inputs), targets).backward()
    true_norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm().item()
    runtime = Runtime(precision="fp16", grad_clip_norm=1e9, context=CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = runtime.prepare(model, optimizer)
    with runtime.autocast():
        loss = nn.functional.cross_entropy(model(inputs), targets)
    runtime.backward(loss)
    runtime.optimizer_step()
    assert runtime.scaler.get_scale() > 1
    assert runtime.last_grad_norm.item() == pytest.approx(true_norm, rel=0.05)


def test_optimizer_step_without_optimizer_says_what_to_do():
    runtime = Runtime(precision="fp32", context=CPU)
    runtime.prepare(_model())
    with pytest.raises(RuntimeError, match=r"runtime.prepare"):
        runtime.optimizer_step()


def test_activation_checkpointing_keeps_gradients():
    from skylift.train.model_tools import apply_activation_checkpointing

    inputs, targets = _data(8)
    plain = _model()
    checkpointed = _model()
    assert apply_activation_checkpointing(checkpointed, ["Linear"]) == 2
    for model in (plain, checkpointed):
        nn.functional.cross_entropy(model(inputs), targets).backward()
    for got, want in zip(checkpointed.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_activation_checkpointing_that_matches_nothing_is_an_error():
    from skylift.train.model_tools import apply_activation_checkpointing

    with pytest.raises(ValueError, match="matched no submodule.*Linear"):
        apply_activation_checkpointing(_model(), ["BasicBlock"])

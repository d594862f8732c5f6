"""The state the checkpoint benchmark saves: an MLP, AdamW after a step, a LambdaLR.

fp32, on the CPU or a CUDA GPU (``--device cuda``: then a save's copy is device to
pinned host memory, overlapped with the next forward and backward). ``width=2048, depth=24`` gives 100.7M parameters; with AdamW's
``exp_avg`` and ``exp_avg_sq`` that is ~1.2 GB of tensors per checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from skylift.checkpoint.state import Snapshot, capture

__all__ = ["Workload", "build_workload"]

BATCH_SIZE = 8
SEED = 0
LR = 1e-4
WARMUP_STEPS = 100


@dataclass
class Workload:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    inputs: torch.Tensor
    targets: torch.Tensor
    step: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Host buffers reused between saves, as the Trainer keeps them."""
    hold: Callable[[], float] | None = None
    """Called before each optimizer step: waits for a background save's deferred copy."""

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def train(self, steps: int) -> list[float]:
        """Run ``steps`` optimizer steps; return each one's wall seconds."""
        step_s = []
        for _ in range(steps):
            started_s = time.perf_counter()
            loss = nn.functional.mse_loss(self.model(self.inputs), self.targets)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            if self.inputs.is_cuda:  # the step is over when the device is done with it
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - started_s)
        return step_s

    def capture_for(self, step: int, defer: bool = False) -> Callable[[], Snapshot]:
        """What ``CheckpointManager.save`` is given: skylift's capture of this state.

        As in the Trainer, a save written before training goes on (not ``defer``)
        writes host tensors from where they are. ``defer`` is what the Trainer does for background saves: parameters and optimizer
        state are copied by the writer thread while the next forward/backward runs.
        """
        counters = {"step": step, "epoch": 0, "samples_seen": step * BATCH_SIZE}
        return lambda: capture(
            step=step, rank=0, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
            scaler=None, counters=counters, buffers=self.buffers, defer=defer, reference_host_tensors=not defer,
        )  # fmt: skip

    def before_optimizer_step(self, *_: object) -> None:
        if self.hold is not None:
            self.hold()


def build_workload(width: int, depth: int, device: str = "cpu") -> Workload:
    """Build the model on ``device`` and take one training step, so the optimizer state exists."""
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP_STEPS))
    inputs, targets = (torch.randn(BATCH_SIZE, width, device=device) for _ in range(2))
    workload = Workload(model, optimizer, scheduler, inputs, targets)
    optimizer.register_step_pre_hook(workload.before_optimizer_step)
    workload.train(1)
    return workload

"""An exponential moving average of the weights (``optim.ema_decay``).

``torch.optim.swa_utils.AveragedModel`` with PyTorch's EMA update, its buffers (batch
norm statistics) averaged too. Updated after every optimizer step on every rank (the
replicas hold equal weights, so their averages stay equal); evaluated and saved as the
final model in place of the raw weights; part of each checkpoint, so a resumed run
continues the same average.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

__all__ = ["WeightAverage"]


class WeightAverage:
    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

    @property
    def module(self) -> nn.Module:
        """The averaged copy of the model (what evaluation and the final save use)."""
        return self.average.module

    def update(self, model: nn.Module) -> None:
        self.average.update_parameters(model)

    def state(self) -> dict[str, torch.Tensor]:
        """The average's tensors, for ``Runtime.resume(extra=...)``: saved with each
        checkpoint and filled in place on a resume."""
        return {f"ema.{name}": tensor for name, tensor in self.average.state_dict().items()}

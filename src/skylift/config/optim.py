"""Optimizer, learning-rate schedule and gradient accumulation settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from skylift.config.section import Section as _Section

__all__ = ["AccumulationConfig", "OptimConfig", "ScheduleConfig"]


class OptimConfig(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""

    lr: float = Field(default=3e-3, gt=0.0)
    """Peak learning rate, reached at the end of warmup."""

    weight_decay: float = Field(default=0.01, ge=0.0)
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""

    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """SGD momentum (ignored by AdamW)."""

    nesterov: bool = False
    """SGD with Nesterov momentum (the ResNet reference recipes use it)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OptimConfig:
        if self.nesterov and (self.name != "sgd" or self.momentum == 0.0):
            raise ValueError("optim.nesterov needs optim.name: sgd and optim.momentum > 0")
        return self

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1, beta2."""

    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """Kernel family. ``auto`` takes ``fused`` on CUDA and ``foreach`` on CPU, the fastest
    of each that PyTorch provides."""

    grad_clip_norm: float | None = Field(default=1.0, gt=0.0)
    """Clip the global gradient L2 norm to this value (after unscaling fp16 gradients);
    ``null`` disables clipping."""

    ema_decay: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Keep an exponential moving average of the weights with this decay per optimizer
    step (e.g. 0.9999); evaluation and the final model then use the average."""


class ScheduleConfig(_Section):
    epochs: int = Field(default=10, ge=1)
    """Passes over the training set."""

    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimizer steps, even mid-epoch; ``null`` runs all epochs."""

    lr_schedule: Literal["warmup_cosine", "warmup_linear", "constant"] = "warmup_cosine"
    """Learning-rate shape over the run: linear warmup, then cosine or linear decay."""

    warmup_steps: int = Field(default=20, ge=0)
    """Optimizer steps of linear warmup from 0 to ``optim.lr``."""

    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Final learning rate as a fraction of ``optim.lr``."""

    eval_every_epochs: int = Field(default=1, ge=1)
    """Evaluate on the validation set every this many epochs (and after the last)."""


class AccumulationConfig(_Section):
    steps: int = Field(default=1, ge=1, le=1024)
    """Micro-batches per optimizer step. Gradients of non-final micro-steps are not
    all-reduced (DDP ``no_sync``)."""

"""The typed run configuration.

Every field carries its documentation as an attribute docstring; ``skylift check
--explain`` prints them. Sections reject unknown keys, so a typo fails before any
process, GPU or cloud call is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from skylift.config.checkpoint import CheckpointConfig, PreemptionConfig
from skylift.config.data import DataConfig
from skylift.config.distributed import DistributedConfig, FsdpConfig
from skylift.config.monitor import CloudWatchConfig, GuardsConfig, MonitorConfig
from skylift.config.moved import moved_key_problems
from skylift.config.optim import AccumulationConfig, OptimConfig, ScheduleConfig
from skylift.config.plan import PlanConfig
from skylift.config.section import Section as _Section
from skylift.config.submit import SubmitConfig

__all__ = [
    "BUILTIN_RECIPES",
    "AccumulationConfig",
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "CloudWatchConfig",
    "CompileConfig",
    "DataConfig",
    "DistributedConfig",
    "FsdpConfig",
    "GuardsConfig",
    "MonitorConfig",
    "OptimConfig",
    "PlanConfig",
    "PrecisionName",
    "PreemptionConfig",
    "RecipeConfig",
    "RunConfig",
    "ScheduleConfig",
    "is_import_path",
]

PrecisionName = Literal["auto", "fp32", "tf32", "fp16", "bf16"]
BUILTIN_RECIPES = ("image_classification", "text_classification", "causal_lm")


def is_import_path(name: str) -> bool:
    """``package.module:Name`` or ``path/to/file.py:Name``: the user's own code."""
    module, sep, attribute = name.rpartition(":")
    return bool(sep and module and attribute.isidentifier())


class RecipeConfig(_Section):
    """The task, and its own settings flat beside its name: ``recipe: {name:
    image_classification, model: resnet18, dataset: shapes}``. The settings are the
    recipe's: its ``Settings`` class validates them where the recipe is resolved
    (``skylift check``, ``skylift submit``, before any worker; the built-ins' without
    importing torch), refusing an unknown key with the closest valid one. The built-in
    recipes' settings are listed in the configuration reference."""

    model_config = ConfigDict(extra="allow")  # the recipe's settings: its Settings class refuses unknown keys

    name: str = "image_classification"
    """The task that ties model, data and loss together (see ``skylift.recipes``):
    ``image_classification`` (``small_cnn``, torchvision models), ``text_classification``
    (Hugging Face sequence classifiers), ``causal_lm`` (Hugging Face causal language
    models fine-tuned on JSONL documents), or your own :class:`~skylift.recipes.base.Recipe` by import
    path: ``package.module:ClassName``, or a file relative to the config's folder,
    ``./tasks.py:MyTask``. Reserved: no recipe has a setting of this name."""

    @field_validator("name")
    @classmethod
    def _known_or_import_path(cls, name: str) -> str:
        if name in BUILTIN_RECIPES or is_import_path(name):
            return name
        raise ValueError(
            f"{name!r} is neither a built-in recipe ({', '.join(BUILTIN_RECIPES)}) nor an import path "
            "such as my_package.tasks:MyTask or ./tasks.py:MyTask"
        )


class CompileConfig(_Section):
    enabled: bool = False
    """Wrap the model in ``torch.compile``. Off by default: measured on 2 CPU cores it
    costs 20-27 s of cold compilation and gains nothing; on GPUs it often pays."""

    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """``torch.compile`` mode."""


class ActivationCheckpointingConfig(_Section):
    enabled: bool = False
    """Recompute activations in backward to save memory (``torch.utils.checkpoint``)."""

    module_types: list[str] = Field(default_factory=lambda: ["BasicBlock", "Bottleneck"])
    """Class names of the submodules to checkpoint (for example torchvision's
    ``BasicBlock``). Models with their own switch (Hugging Face
    ``activation_checkpointing_enable``) use it instead."""


class RunConfig(_Section):
    """A complete, validated description of one training run."""

    run_dir: Path = Path("runs/default")
    """Folder for everything the run writes: ``config.yaml``, ``metrics.jsonl``,
    TensorBoard events, ``summary.json`` and the final model."""

    seed: int = Field(default=0, ge=0)
    """Seeds Python, NumPy and torch on every rank, the data order and the split."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` takes CUDA when a GPU is visible, else the CPU."""

    precision: PrecisionName = "auto"
    """Numeric format. ``auto``: bf16 on CUDA compute capability >= 8.0, fp16 with a
    GradScaler on 7.x, bf16 autocast on CPUs with native bf16 (AVX512-BF16 or AMX),
    else fp32. ``tf32`` is fp32 with TensorFloat-32 matmuls on Ampere and newer."""

    channels_last: bool = False
    """Use the channels-last memory format for conv nets (faster on tensor cores and
    with oneDNN bf16)."""

    deterministic: bool = False
    """Use deterministic algorithms only (slower); needed for bitwise-reproducible runs."""

    recipe: RecipeConfig = Field(default_factory=RecipeConfig)
    """The task (``recipe.name``) and its own settings beside it: the model, the dataset,
    the loss's options."""

    data: DataConfig = Field(default_factory=DataConfig)
    """How samples are streamed, split, batched and loaded (every recipe's; which
    dataset is the recipe's setting)."""

    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The optimizer."""

    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """How long to train, the learning-rate shape and evaluation cadence."""

    accumulation: AccumulationConfig = Field(default_factory=AccumulationConfig)
    """Gradient accumulation."""

    compile: CompileConfig = Field(default_factory=CompileConfig)
    """``torch.compile``."""

    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    """Activation checkpointing."""

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Multi-process settings, used when started with ``--nproc`` or under torchrun."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """What the run saves, where, and how it resumes."""

    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    """Spot-notice and signal handling."""

    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Metrics, TensorBoard and the progress bar."""

    plan: PlanConfig = Field(default_factory=PlanConfig)
    """What ``skylift plan`` assumes for this job (your prices, spot interruption rates,
    restart time); ``skylift run`` ignores it."""

    submit: SubmitConfig = Field(default_factory=SubmitConfig)
    """Where and how ``skylift submit`` sends this run (platform options, spot, limits,
    resubmits); ``skylift run`` ignores it."""

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, raw: Any) -> Any:
        problems = moved_key_problems(raw)
        if problems:  # parse_config lists them one a line; this guards a direct model_validate
            raise ValueError("; ".join(problems))
        return raw

    @model_validator(mode="after")
    def _warmup_fits(self) -> RunConfig:
        if self.schedule.max_steps is not None and self.schedule.warmup_steps > self.schedule.max_steps:
            raise ValueError(
                f"schedule.warmup_steps ({self.schedule.warmup_steps}) exceeds schedule.max_steps "
                f"({self.schedule.max_steps}); lower warmup_steps or raise max_steps"
            )
        return self

    @model_validator(mode="after")
    def _one_micro_batch_setting(self) -> RunConfig:
        micro = self.data.micro_batch_size
        if micro is None:
            return self
        if self.accumulation.steps != 1:
            raise ValueError(
                f"data.micro_batch_size ({micro}) and accumulation.steps ({self.accumulation.steps}) both set the "
                "micro-batch; keep one (accumulation follows from data.micro_batch_size)"
            )
        if self.data.batching == "token_budget":
            raise ValueError("data.batching: token_budget sizes micro-batches by data.max_tokens; "
                             "remove data.micro_batch_size")
        return self

    def micro_batch_size(self, world_size: int) -> int:
        """Per-rank samples per micro-step (with ``data.micro_batch_size: auto``, the
        largest candidate, before the trials); raises ``ValueError`` naming the fields."""
        per_rank = self._per_rank_batch(world_size)
        micro = self.data.micro_batch_size
        if micro is None:
            return self.data.global_batch_size // (world_size * self.accumulation.steps)
        if micro == "auto":
            return per_rank
        if per_rank % micro:
            raise ValueError(
                f"data.micro_batch_size ({micro}) must divide the per-rank batch, data.global_batch_size "
                f"({self.data.global_batch_size}) / world_size ({world_size}) = {per_rank}; choose a divisor "
                f"of {per_rank}, or auto"
            )
        return micro

    def with_micro_batch(self, micro_batch_size: int, world_size: int) -> RunConfig:
        """A copy with the micro-batch spelled as ``accumulation.steps`` (what the loaders
        and the runtime read); ``micro_batch_size`` must divide the per-rank batch."""
        per_rank = self._per_rank_batch(world_size)
        if per_rank % micro_batch_size:
            raise ValueError(f"micro-batch {micro_batch_size} does not divide the per-rank batch {per_rank}")
        resolved = self.model_copy(deep=True)
        resolved.data.micro_batch_size = None
        resolved.accumulation.steps = per_rank // micro_batch_size
        return resolved

    def _per_rank_batch(self, world_size: int) -> int:
        divisor = world_size * (self.accumulation.steps if self.data.micro_batch_size is None else 1)
        if self.data.global_batch_size % divisor:
            what = f"world_size ({world_size})" if divisor == world_size else (
                f"world_size ({world_size}) x accumulation.steps ({self.accumulation.steps}) = {divisor}")
            raise ValueError(
                f"data.global_batch_size ({self.data.global_batch_size}) must divide by {what}; "
                f"set data.global_batch_size to a multiple of {divisor}"
            )
        return self.data.global_batch_size // world_size

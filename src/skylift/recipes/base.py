"""What a recipe gives the Trainer: a model, data, a loss and evaluation sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from skylift.data.datasets import DatasetSplit

__all__ = ["Recipe", "classification_sums"]


def classification_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Evaluation sums of a classifier: summed cross-entropy, correct predictions, count
    (``Recipe.summarize`` turns them into ``loss`` and ``accuracy``)."""
    import torch.nn.functional as F

    logits = logits.float()
    return {
        "loss_sum": F.cross_entropy(logits, labels, reduction="sum"),
        "accuracy_sum": (logits.argmax(dim=1) == labels).sum().float(),
        "count": torch.tensor(float(labels.numel()), device=labels.device),
    }


class Recipe:
    """Subclass and implement the four methods; the Trainer does the rest.

    Evaluation returns *sums* per batch (``{"loss_sum": ..., "correct": ...,
    "count": ...}``) rather than means, so the Trainer can add them across batches and
    ranks with one all-reduce and get exact metrics however the data was sharded.

    A recipe names its settings in a :class:`~skylift.recipes.settings.base.RecipeSettings`
    subclass ``Settings``; the keys beside ``recipe.name`` are validated against it
    (unknown keys refused, with the closest valid key) and arrive as ``self.settings``::

        class MyTask(Recipe):
            class Settings(RecipeSettings):
                hidden: int = 64
                '''Width of the hidden layer.'''

            def build_model(self, data):
                return MyNet(self.settings.hidden, data.num_classes)

    (``recipe: {name: ./tasks.py:MyTask, hidden: 128}``.)
    """

    Settings: ClassVar[type[BaseModel] | None] = None

    def __init__(self, config: Any) -> None:
        self.config = config
        self.settings = self.parse_settings(config)

    @classmethod
    def parse_settings(cls, config: Any) -> Any:
        """``config.recipe``'s settings validated by ``cls.Settings`` (raises
        SkyliftConfigError naming each key); ``config.recipe`` then lists every one."""
        from skylift.recipes.settings import validate_settings

        return validate_settings(cls.__name__, cls.Settings, config)

    def build_datasets(self) -> DatasetSplit:
        raise NotImplementedError

    def build_model(self, data: DatasetSplit) -> nn.Module:
        raise NotImplementedError

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss over the micro-batch: over its samples, or over the
        :meth:`loss_count` terms when the recipe counts them."""
        raise NotImplementedError

    def loss_count(self, batch: Any) -> torch.Tensor | None:
        """How many terms ``training_loss`` averages over in ``batch``, where that is not
        its number of samples (a language model's labelled tokens: prompt masks and
        padding make it differ between micro-batches); ``None``: the samples.

        With a count, the Trainer fetches a step's micro-batches first, sums their
        counts over the ranks (one all-reduce) and weighs each micro-batch's mean, so
        that the step's loss is the sum over every counted term of the step divided
        by their number, however they fell into micro-batches and ranks."""
        return None

    def training_sums(self, batch: Any) -> dict[str, torch.Tensor] | None:
        """Sums of extra training metrics over the micro-batch ``batch`` that
        :meth:`training_loss` has just computed (it may keep them), with their ``count``:
        the Trainer adds them over the step's micro-batches and logs each ``NAME_sum``
        divided by the count as ``NAME`` in the step's ``train`` record, averaged over the
        ranks (exact when the ranks count alike). ``None``: none (the default)."""
        return None

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Turn summed evaluation counts into the reported metrics."""
        count = max(sums.get("count", 0.0), 1.0)
        return {key.removesuffix("_sum"): value / count for key, value in sums.items() if key != "count"}

    def collate(self, train: bool) -> Any:
        """How the loader joins samples into a batch (``train``: the training loader);
        ``None``: PyTorch's default, which stacks equal-shaped tensors."""
        return None

    def decoder(self, fields: list[str]) -> Any:
        """How to turn a streamed sample (field -> bytes) into what ``training_loss`` takes.

        Runs in the DataLoader workers. For training, each call runs on the CPU generator
        seeded by (run seed, epoch, sample id), so random augmentation in it is the same
        whichever worker runs it and after a resume."""
        raise NotImplementedError(f"{type(self).__name__} cannot read sharded datasets")

    def eval_decoder(self, fields: list[str]) -> Any:
        """The decoder of evaluation samples (no augmentation); default: :meth:`decoder`."""
        return self.decoder(fields)

    def weights_source(self) -> Path | None:
        """A folder of ``*.safetensors`` files whose tensors, by parameter name, hold the
        model's starting weights (a Hugging Face folder), so a sharded run can build the
        model on the meta device and load each rank's shards from there; ``None``:
        :meth:`build_model` initialises the weights itself."""
        return None

    def weights_name(self, name: str) -> str | None:
        """The name in :meth:`weights_source`'s files of the model's tensor ``name`` (a
        wrapper's parameter under its wrapped name); ``None``: a tensor the folder does not
        hold, which :meth:`initialise_unloaded` fills. Default: the same name."""
        return name

    def initialise_unloaded(self, model: nn.Module) -> None:
        """Fill the tensors :meth:`weights_name` leaves out, once the others are loaded
        (on a sharded model each rank fills its own rows), exactly as :meth:`build_model`
        fills them on a real device. Default: there are none."""

    def export_pretrained(self, state_dict: dict[str, torch.Tensor], out_dir: Path, *,
                          dtype: torch.dtype = torch.float32) -> list[Path]:
        """Write the trained weights ``state_dict`` (parameter name -> full tensor) as a
        folder its users load without skylift (Hugging Face ``save_pretrained``: config,
        safetensors weights, tokenizer), in ``dtype``; return the files written.
        ``skylift export`` calls it."""
        raise NotImplementedError(f"{type(self).__name__} does not export a Hugging Face folder")

    def batch_size(self, batch: Any) -> int:
        first = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
        return int(first.shape[0])

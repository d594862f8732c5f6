"""The per-sample loss of a Hugging Face ``Trainer`` step, whatever its logging did to it.

The Trainer hands a model that takes ``**kwargs`` the global batch's item count
(``num_items_in_batch``) and, trusting the model to divide its summed loss by it,
multiplies the loss by the number of processes (with ``average_tokens_across_devices``,
the default) and skips its own division by the gradient accumulation steps. A model
that uses the count (every model whose loss goes through ``self.loss_function``: the
causal LMs TRL, Axolotl and LLaMA-Factory train) then logs the per-sample loss. A model
that takes ``**kwargs`` but computes a per-sample mean itself (BERT's sequence
classification head, say) logs that mean times the processes times the accumulation
steps: 1.38 for an untrained two-class head on 2 processes, where one process logs 0.69.

:class:`PerSampleLoss` watches the model's forward passes to learn which kind it is:
whether the count was passed, and whether the model's ``loss_function`` was called with
it. Only a model whose class has that property is judged; for any other the Trainer's
figure stands (skylift cannot see whether such a model used the count).
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

__all__ = ["PerSampleLoss"]


class PerSampleLoss:
    """Learns from the first training forward pass whether the Trainer over-scaled the loss.

    Args:
        model: the Trainer's model (the one its callbacks receive).
        processes: the Trainer's world size.
        averaged_across_processes: ``TrainingArguments.average_tokens_across_devices``.
    """

    def __init__(self, model: nn.Module, *, processes: int, averaged_across_processes: bool) -> None:
        self.model = model
        self.processes = processes
        self.averaged_across_processes = averaged_across_processes
        self.ignores_item_count: bool | None = None
        """True: the model got the item count and computed its own mean; None: not known (yet)."""
        self._passed = self._used = False
        self._forwards = 0
        self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                         model.register_forward_hook(self._after)]
        self._restore: Any = None
        declared = getattr(type(model), "loss_function", None)
        if isinstance(declared, property) and declared.fset is not None:
            had_own = "_loss_function" in vars(model)
            previous = cast(Any, model).loss_function  # a PreTrainedModel's property

            def tracking(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("num_items_in_batch") is not None:
                    self._used = True
                return previous(*args, **kwargs)

            cast(Any, model).loss_function = tracking
            self._restore = (lambda: setattr(model, "loss_function", previous)) if had_own else (
                lambda: delattr(model, "_loss_function"))

    def _before(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            self._passed = kwargs.get("num_items_in_batch") is not None
            self._used = False

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return
        self._forwards += 1
        if self.ignores_item_count is None and self._restore is not None:
            self.ignores_item_count = self._passed and not self._used

    def per_sample(self, logged_loss: float, steps: int) -> float:
        """The Trainer's logged loss over ``steps`` optimizer steps as the per-sample loss;
        starts the next logging interval."""
        forwards, self._forwards = self._forwards, 0
        if not self.ignores_item_count or steps <= 0 or forwards <= 0:
            return logged_loss
        processes = self.processes if self.averaged_across_processes else 1
        return logged_loss / (processes * forwards / steps)

    def close(self) -> None:
        """Remove the hooks and give the model its own ``loss_function`` back."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._restore is not None:
            self._restore()
            self._restore = None

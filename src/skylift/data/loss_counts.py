"""The micro-batches of one optimizer step, each with the count its loss averages over.

Accumulation averages a step's micro-batch losses over its ``A`` micro-steps and DDP
over its ``W`` ranks, with equal weights. That is the mean over the step's terms only
when every micro-batch holds as many terms. A micro-batch whose loss is the mean over
``n_i`` terms of a step that holds ``N`` in all (over every micro-batch and rank) is
weighed by ``n_i * A * W / N`` (:func:`~skylift.data.loaders.micro_batch_weight`), and
the step's loss is then the sum of every term divided by ``N``.

The terms are samples (``N`` known from the batching plan, no collective), or, for a
recipe whose :meth:`~skylift.recipes.base.Recipe.loss_count` counts them, the labelled
tokens of a language model: prompt masks and padding make ``n_i`` differ between
micro-batches. Then the step's micro-batches are fetched before its first forward, and
one all-reduce of their summed counts gives ``N`` (what Hugging Face's Trainer does for
``num_items_in_batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from skylift.loop.collectives import collective

__all__ = ["step_micro_batches"]


def step_micro_batches(fetch: Callable[[], Any], recipe: Any, *, accumulation_steps: int, step_samples: int,
                       distributed: bool) -> Iterator[tuple[Any, Any, Any]]:
    """``(batch, count, step_count)`` for each of this rank's ``accumulation_steps``
    micro-batches of the step: the batch, the number of terms its loss averages over,
    and the step's total over every micro-batch and rank.

    Counted by samples (``recipe.loss_count`` returns ``None``), batches are fetched one
    at a time, as they are needed. Counted by the recipe, all of the step's batches are
    fetched at once, and the counts are tensors on the batches' device (no host sync).

    Args:
        fetch: returns the next batch, on the device.
        recipe: has ``loss_count(batch)`` and ``batch_size(batch)``.
        step_samples: the step's samples across all ranks, from the batching plan.
        distributed: whether the ranks' counts must be summed (one all-reduce).
    """
    count_of = getattr(recipe, "loss_count", None)  # a duck-typed recipe may not define it: samples
    first = fetch()
    first_count = count_of(first) if count_of is not None else None
    if count_of is None or first_count is None:
        batch = first
        for index in range(accumulation_steps):
            batch = first if index == 0 else fetch()
            yield batch, recipe.batch_size(batch), step_samples
        return
    batches = [first, *(fetch() for _ in range(accumulation_steps - 1))]
    counts = [torch.as_tensor(first_count), *(torch.as_tensor(count_of(batch)) for batch in batches[1:])]
    step_count = torch.stack(counts).sum().to(torch.int64)
    if distributed:
        with collective("the step's labelled-token count (all_reduce)"):
            dist.all_reduce(step_count, op=dist.ReduceOp.SUM)
    # A step without a single labelled token gives every micro-batch weight 0, not 0/0.
    step_count = step_count.clamp(min=1)
    for batch, count in zip(batches, counts, strict=True):
        yield batch, count, step_count

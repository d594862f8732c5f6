"""Token-budget batches as the Trainer consumes them: optimizer steps, ranks, resume.

:class:`~skylift.data.token_budget.TokenBudgetBatchSampler` plans an epoch's batches
(the same plan on every rank). This adapter gives the Trainer what
:class:`~skylift.data.sampler.GlobalBatchSampler` gives: ``set_epoch(epoch,
start_step)``, a ``steps_per_epoch`` that is the same for every epoch, and a state to
resume from. Optimizer step ``s`` of an epoch takes the plan's batches ``[s*A*W,
(s+1)*A*W)`` (``A`` accumulation steps, ``W`` ranks), rank ``r`` the ones at
positions ``r, r+W, ...`` of that window. Since every rank knows the whole plan, each
can count the samples of every step across all ranks without a collective.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from skylift.data.token_budget import TokenBudgetBatchSampler

__all__ = ["TokenBudgetSteps"]


class TokenBudgetSteps(Sampler[list[int]]):
    """This rank's micro-batches under a token budget, ``accumulation_steps`` per step.

    Args:
        lengths: tokens per sample.
        max_tokens: padded tokens per micro-batch on each rank.
        accumulation_steps: micro-batches per optimizer step on each rank.
        rank, world_size: this process's place in the job.
        seed: with the epoch, fixes the plan.
        epochs: epochs the run may train; ``steps_per_epoch`` is the least any of them
            holds, so it stays constant (a resume derives epoch and step from it) and
            the few batches past it in an epoch are dropped.

    Raises:
        ValueError: a sample exceeds ``max_tokens``, or an epoch holds fewer batches
            than one optimizer step takes.
    """

    shards_by_rank = True

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        accumulation_steps: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        epochs: int,
    ) -> None:
        self.planner = TokenBudgetBatchSampler(lengths, max_tokens, seed=seed)
        self.lengths = [int(length) for length in lengths]
        self.accumulation_steps, self.rank, self.world_size = accumulation_steps, rank, world_size
        self.batches_per_step = accumulation_steps * world_size
        self.steps_per_epoch = min(len(self._plan(epoch)) // self.batches_per_step for epoch in range(epochs))
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"an epoch holds fewer token-budget batches than one optimizer step takes ({self.batches_per_step}: "
                "world_size x accumulation.steps); lower data.max_tokens or add samples"
            )
        self.epoch, self.start_step = 0, 0
        self._step_samples: tuple[int, list[int]] | None = None

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's plan and skip its first ``start_step`` optimizer steps."""
        self.epoch, self.start_step = epoch, start_step

    def __iter__(self) -> Iterator[list[int]]:
        used = self._used(self.epoch)
        yield from used[self.start_step * self.batches_per_step + self.rank :: self.world_size]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.accumulation_steps

    def samples_in_step(self, step: int) -> int:
        """Samples that optimizer step ``step`` (0-based, counted over the whole run)
        takes on all ranks together."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._step_samples is None or self._step_samples[0] != epoch:
            sizes = [len(batch) for batch in self._used(epoch)]
            self._step_samples = (epoch, [sum(sizes[i : i + self.batches_per_step])
                                          for i in range(0, len(sizes), self.batches_per_step)])  # fmt: skip
        return self._step_samples[1][index]

    def epoch_record(self) -> dict[str, Any]:
        """What the epoch's batches cost: padding share, real and padded tokens, counts."""
        used = self._used(self.epoch)
        real_tokens = sum(self.lengths[i] for batch in used for i in batch)
        padded_tokens = sum(len(batch) * max(self.lengths[i] for i in batch) for batch in used)
        return {
            "batching": "token_budget",
            "padding_share": round(1.0 - real_tokens / padded_tokens, 6),
            "real_tokens": real_tokens,
            "padded_tokens": padded_tokens,
            "batches": len(used),
            "samples": sum(len(batch) for batch in used),
            "steps": self.steps_per_epoch,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start_step": self.start_step, "seed": self.planner.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planner.load_state_dict({"epoch": int(state["epoch"]), "start_batch": 0, "seed": int(state["seed"])})
        self._step_samples = None
        self.set_epoch(int(state["epoch"]), int(state["start_step"]))

    def _plan(self, epoch: int) -> list[list[int]]:
        self.planner.set_epoch(epoch)
        return self.planner.all_batches()

    def _used(self, epoch: int) -> list[list[int]]:
        """The epoch's batches that steps take: the plan cut to whole steps."""
        return self._plan(epoch)[: self.steps_per_epoch * self.batches_per_step]

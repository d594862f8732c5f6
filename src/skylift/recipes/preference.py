"""DPO for the causal LM (``recipe.objective: dpo``): the sigmoid loss of TRL's ``DPOTrainer``.

A batch holds B pairs (:func:`skylift.data.preference.preference_collate`, tensors of
``(B, 2, T)``); the model reads its 2B sequences in one forward, chosen first, then
rejected (TRL's layout). A sequence's log-probability is the sum of its completion
tokens' log-probabilities (TRL's ``per_token_logps.sum(dim=1)``, ``ld_alpha`` unset).

Per pair, with ``d = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))``::

    loss = -(1 - s) log sigmoid(beta d) - s log sigmoid(-beta d)

(``s``: ``recipe.dpo.label_smoothing``, 0 by default, which is TRL 1.16's ``sigmoid``
loss exactly), the rewards ``beta (log pi - log ref)`` of each completion, their margin,
and the accuracy (chosen reward above the rejected one), TRL's ``rewards/*`` metrics.
TRL means the loss over a micro-batch's pairs; here a step's loss is the sum over every
pair of the step divided by their number, across micro-batches and ranks
(:meth:`~skylift.recipes.base.Recipe.loss_count` counts pairs), the same when the
micro-batches hold as many pairs.

The reference log-probabilities are computed without gradient: under ``recipe.lora``
by the same model with its adapters switched off (PEFT's ``disable_adapter``, what TRL
does for a PEFT model without ``ref_model``), for a full fine-tune by a frozen copy of
the starting model (:class:`Reference`).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from skylift.data.jsonl_text import IGNORE_INDEX

__all__ = ["REWARD_SCALARS", "Reference", "dpo_losses", "pair_sums", "sequence_log_probs"]

REWARD_SCALARS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""The reward metrics, named as TRL's ``DPOTrainer`` logs them."""


def sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per sequence, the summed log-probability of its labelled tokens (``labels``
    shifted already; -100 carries none), in fp32."""
    per_token = -F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="none")  # fmt: skip
    return per_token.view(labels.shape).sum(dim=1)


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
               reference_rejected: torch.Tensor, *, beta: float,
               label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, the chosen completion's reward and the rejected one's (detached)."""
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    logits = beta * (chosen_ratio - rejected_ratio)
    losses = -F.logsigmoid(logits)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-logits)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_sums(losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, Any]:
    """Sums over a batch's pairs (``count``: their number), for exact means across batches and ranks."""
    return {
        "loss_sum": losses.detach().sum(),
        "rewards/chosen_sum": chosen_rewards.sum(),
        "rewards/rejected_sum": rejected_rewards.sum(),
        "rewards/margins_sum": (chosen_rewards - rejected_rewards).sum(),
        "rewards/accuracies_sum": (chosen_rewards > rejected_rewards).float().sum(),
        "count": torch.tensor(float(len(losses)), device=losses.device),
    }


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module under DDP (its forward would wait for a backward) and ``torch.compile``."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


class Reference:
    """The reference model's log-probabilities of a batch's sequences, without gradient.

    ``base_without_adapters``: the policy itself with PEFT's adapters (and
    ``modules_to_save`` copies) switched off. ``frozen_copy``: a copy of the model taken
    by :meth:`keep_copy` when it is built, before any training, so a resumed run's
    reference is the starting model too (the checkpoint loads into the policy only)."""

    def __init__(self, kind: str, *, precomputed: bool = False) -> None:
        self.kind = kind
        self.precomputed = precomputed
        """``recipe.dpo.precompute_reference``: the values come from a table computed before
        training (:mod:`~skylift.recipes.reference_table`); a ``frozen_copy`` reference then
        keeps no copy and reads the policy itself, which is the starting model until the
        table is in place (:meth:`retire` then forbids it)."""
        self.retired = False
        self.copy: nn.Module | None = None

    def keep_copy(self, model: nn.Module) -> None:
        """Copy the model as built; under FSDP the trainer then shards the copy as it shards
        the policy (built on ``meta``, the copy is the structure, and loads its shards
        from the weights folder as the policy does)."""
        if self.kind == "frozen_copy" and not self.precomputed:
            self.copy = copy.deepcopy(model).eval().requires_grad_(False)

    def retire(self) -> None:
        """The precomputed table is in place: from now on the policy trains away from the
        starting model, and a ``frozen_copy`` reference read from it would be wrong."""
        self.retired = True

    @torch.no_grad()
    def log_probs(self, policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
        if self.kind == "base_without_adapters":
            model = _unwrapped(policy)
            with cast(Any, model).disable_adapter():  # a PeftModel's
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            return sequence_log_probs(logits, labels)
        if self.copy is None and self.precomputed and not self.retired:  # the policy is the starting model still
            return sequence_log_probs(_unwrapped(policy)(input_ids=input_ids, attention_mask=attention_mask).logits,
                                      labels)  # fmt: skip
        if self.copy is None:
            raise RuntimeError("the frozen reference copy was never taken (build_model keeps it), or the precomputed "
                               "table is in place and the policy has moved from the starting model")
        sharded = hasattr(self.copy, "reshard")  # an FSDPModule: placed as the policy is
        if not sharded and self.copy.get_input_embeddings().weight.device != input_ids.device:  # type: ignore[operator]
            self.copy.to(input_ids.device)
        return sequence_log_probs(self.copy(input_ids=input_ids, attention_mask=attention_mask).logits, labels)

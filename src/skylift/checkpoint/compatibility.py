"""Which settings a resume may change: the checkpoint's recorded config against the run's.

Every manifest records the configuration of the run that wrote it (:func:`recorded_config`:
secrets redacted, ``precision`` as resolved on that machine). Before a resume loads a
checkpoint, each field whose value differs is judged by :data:`RULES`, the one table of
them (longest matching prefix wins):

- ``refuse``: the saved state's shape or meaning depends on it (the model, the recipe, the
  optimizer's kind, the GradScaler that only fp16 keeps, the samples, the split and their
  order, which the loader's saved place points into). The resume stops on every rank
  before anything loads: exit 2, one line naming each field as ``field: checkpoint value
  -> this run's value``, and the fix.
- ``changeable``: the state takes it; it applies from the first step this run trains, and
  one line says what changed. The optimizer's hyperparameters (``optim.lr``,
  ``weight_decay``, ``betas``, ``momentum``, ``nesterov``, ``implementation``) are saved in
  its parameter groups, which a load puts back: the run's values are put in again after
  the load (:class:`OptimizerSettings`), and the LR schedule continues at the resumed step
  with the run's ``optim.lr`` and ``schedule``.
- ``not compared``: where and how the run is operated (``run_dir``, ``checkpoint``,
  ``plan``, ``submit``), not what it trains.

A checkpoint of an earlier skylift records no config: nothing is compared, it loads as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from skylift.cloud.redact import redact_config

__all__ = ["CHANGEABLE", "FACTS", "FACT_RULES", "NOT_COMPARED", "REFUSE", "RULES", "Difference", "OptimizerSettings",
           "compare", "recorded_config", "refusal", "rule_for", "schema_fields", "summary"]

REFUSE, CHANGEABLE, NOT_COMPARED = "refuse", "changeable", "not compared"


@dataclass(frozen=True)
class Rule:
    kind: str
    why: str
    refuse_when: Callable[[Any, Any], bool] | None = None
    """A ``changeable`` field refused only when this holds for (checkpoint value, run's value)."""
    fix: str | None = None
    """What to do instead of ``--set FIELD=VALUE`` (a fact no setting changes back)."""


def _grad_scaler_differs(saved: Any, now: Any) -> bool:
    return (saved == "fp16") != (now == "fp16")


def _presence_differs(saved: Any, now: Any) -> bool:
    return (saved is None) != (now is None)


_SAMPLES = "the samples, the split or their order, where the loader's saved place points"
RULES: dict[str, Rule] = {
    "run_dir": Rule(NOT_COMPARED, "where the run writes"),
    "checkpoint": Rule(NOT_COMPARED, "where and how checkpoints are kept"),
    "plan": Rule(NOT_COMPARED, "read by skylift plan only"),
    "submit": Rule(NOT_COMPARED, "read by skylift submit only"),
    "seed": Rule(REFUSE, "seeds the split and the data order"),
    "device": Rule(CHANGEABLE, "the state is loaded onto this run's device"),
    "precision": Rule(CHANGEABLE, "only fp16 keeps a GradScaler's state", refuse_when=_grad_scaler_differs),
    "channels_last": Rule(CHANGEABLE, "a memory layout, not a value"),
    "deterministic": Rule(CHANGEABLE, "kernel choice"),
    "recipe": Rule(REFUSE, "the task and its settings: the model, the samples, the loss"),
    "data": Rule(CHANGEABLE, "loading, caching and evaluation"),
    "data.url": Rule(REFUSE, _SAMPLES),
    "data.batching": Rule(REFUSE, _SAMPLES),
    "data.max_tokens": Rule(REFUSE, _SAMPLES),
    "data.global_batch_size": Rule(REFUSE, _SAMPLES),
    "data.val_fraction": Rule(REFUSE, _SAMPLES),
    "data.shuffle_block_shards": Rule(REFUSE, _SAMPLES),
    "optim": Rule(CHANGEABLE, "hyperparameters: the run's values are put back after the load"),
    "optim.name": Rule(REFUSE, "the optimizer state's layout"),
    "optim.ema_decay": Rule(CHANGEABLE, "an average is saved only with one", refuse_when=_presence_differs),
    "schedule": Rule(CHANGEABLE, "the LR schedule continues at the resumed step"),
    "accumulation": Rule(CHANGEABLE, "the global batch stays"),
    "compile": Rule(CHANGEABLE, "how the same model runs"),
    "activation_checkpointing": Rule(CHANGEABLE, "how the same model runs"),
    "distributed": Rule(CHANGEABLE, "a sharded checkpoint loads on any strategy; a whole one under fsdp is refused"),
    "preemption": Rule(CHANGEABLE, "how the run is watched"),
    "monitor": Rule(CHANGEABLE, "how the run is watched"),
}

FACTS = "facts"
"""The recorded config's key for what the run depends on beyond its settings."""
FACT_RULES: dict[str, tuple[str, Rule]] = {
    "base_weights": ("recipe.model_path's weights", Rule(
        REFUSE, "the frozen base the adapters were trained over; the checkpoint holds the adapters only",
        fix="Resume with the base the checkpoint was trained over (the folder's files as they were), or train "
            "from step 0 in a new checkpoint.root (--set checkpoint.root=NEW_FOLDER).")),
}
"""Facts a manifest records (:func:`skylift.recipes.base_weights.frozen_base_facts`), by
name: the field shown and the rule. A fact differs only as a fingerprint."""

# Parameter-group keys a load puts back, by the field the run builds them from.
_GROUP_KEYS = {
    "optim.weight_decay": ("weight_decay",),
    "optim.betas": ("betas",),
    "optim.momentum": ("momentum",),
    "optim.nesterov": ("nesterov",),
    "optim.implementation": ("fused", "foreach"),
}


@dataclass(frozen=True)
class Difference:
    field: str
    saved: Any
    now: Any
    rule: Rule

    @property
    def refused(self) -> bool:
        if self.rule.refuse_when is not None:
            return self.rule.refuse_when(self.saved, self.now)
        return self.rule.kind == REFUSE

    def shown(self) -> str:
        return f"{self.field}: {_value(self.saved)} -> {_value(self.now)}"


def recorded_config(config: BaseModel, precision: str, facts: dict[str, str] | None = None) -> dict[str, Any]:
    """What a manifest records of the run: every field, secrets redacted, ``precision``
    resolved, and ``facts`` (:data:`FACT_RULES`) under :data:`FACTS`."""
    document = redact_config(config.model_dump(mode="json"))
    document["precision"] = precision
    if facts:
        document[FACTS] = dict(facts)
    return document


def schema_fields(config: BaseModel, prefix: str = "") -> Iterator[str]:
    """Dotted names of the config's fields; a free-form mapping (``recipe.model_args``) is one
    field, and so is each of a section's extra keys (the recipe's settings beside ``recipe.name``)."""
    for name in [*type(config).model_fields, *(config.model_extra or {})]:
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            yield from schema_fields(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def rule_for(field: str) -> Rule | None:
    parts = field.split(".")
    for length in range(len(parts), 0, -1):
        rule = RULES.get(".".join(parts[:length]))
        if rule is not None:
            return rule
    return None


def compare(saved: dict[str, Any], config: BaseModel, precision: str,
            facts: dict[str, str] | None = None) -> list[Difference]:
    """The fields whose value differs, in schema order, then the facts that differ. A field
    or fact the checkpoint does not record (added to skylift after it was written) is not
    compared."""
    now = recorded_config(config, precision)
    recorded_facts = saved.get(FACTS) or {}
    differing_facts = [Difference(FACT_RULES[name][0], recorded_facts[name], value, FACT_RULES[name][1])
                       for name, value in (facts or {}).items()
                       if name in FACT_RULES and name in recorded_facts and recorded_facts[name] != value]  # fmt: skip
    differences: list[Difference] = []
    for field in schema_fields(config):
        rule = rule_for(field)
        if rule is None or rule.kind == NOT_COMPARED:
            continue
        found, saved_value = _lookup(saved, field)
        _, now_value = _lookup(now, field)
        if found and saved_value != now_value:
            differences.append(Difference(field, saved_value, now_value, rule))
    return differences + differing_facts


def refusal(differences: list[Difference], where: str) -> tuple[str, str] | None:
    """(problem, fix) when a difference is refused, else None."""
    refused = [difference for difference in differences if difference.refused]
    if not refused:
        return None
    problem = (f"{where} was saved with settings its state depends on, and this run changes them: "
               + "; ".join(difference.shown() for difference in refused))
    fixes = [difference.rule.fix for difference in refused if difference.rule.fix is not None]
    if fixes:
        return problem, fixes[0]
    settings = " ".join(f"--set {difference.field}={_value(difference.saved)}" for difference in refused)
    fix = (f"Resume with the checkpoint's values ({settings}), or train from step 0 in a new checkpoint.root "
           "(--set checkpoint.root=NEW_FOLDER).")
    return problem, fix


def summary(differences: list[Difference], step: int) -> str | None:
    """The one line a resume logs for the changes it takes, or None."""
    if not differences:
        return None
    return (f"resuming step {step} with changed settings, which apply from step {step + 1}, the first this run "
            f"trains: {'; '.join(difference.shown() for difference in differences)}")


class OptimizerSettings:
    """The hyperparameters the run built its optimizer and LR schedule with, taken before the
    load, and put back after it for the fields that changed (the load restores the saved ones)."""

    def __init__(self, optimizer: Any, scheduler: Any) -> None:
        self.groups = [{key: value for key, value in group.items() if key != "params"}
                       for group in optimizer.param_groups]
        self.base_lrs = list(getattr(scheduler, "base_lrs", None) or [group["lr"] for group in self.groups])

    def put_back(self, changed: list[str], optimizer: Any, scheduler: Any) -> None:
        for field in changed:
            for key in _GROUP_KEYS.get(field, ()):
                for group, built in zip(optimizer.param_groups, self.groups, strict=True):
                    if key in built:
                        group[key] = built[key]
        lr_changed = "optim.lr" in changed
        if lr_changed or any(field.startswith("schedule.") for field in changed):
            self._put_back_lr(optimizer, scheduler, lr_changed)

    def _put_back_lr(self, optimizer: Any, scheduler: Any, lr_changed: bool) -> None:
        groups = optimizer.param_groups
        saved_bases = list(getattr(scheduler, "base_lrs", None) or [group["lr"] for group in groups])
        bases = self.base_lrs if lr_changed else saved_bases
        lambdas = getattr(scheduler, "lr_lambdas", None)
        for index, group in enumerate(groups):
            if lambdas is not None:  # skylift's schedule (LambdaLR): the run's shape at the resumed step
                group["lr"] = bases[index] * lambdas[index](scheduler.last_epoch)
            elif lr_changed:  # another schedule: scaled as its base is
                group["lr"] *= bases[index] / saved_bases[index]
            if "initial_lr" in group:
                group["initial_lr"] = bases[index]
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = list(bases)
            scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports


def _lookup(document: dict[str, Any], field: str) -> tuple[bool, Any]:
    value: Any = document
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _value(value: Any) -> str:
    """As ``--set`` takes it back."""
    return value if isinstance(value, str) else json.dumps(value)

"""Verdicts and the rule table (:func:`skylift.doctor.rules.evaluate` runs it).

A rule is one small function from :class:`~skylift.machine.facts.Facts` to a
:class:`Finding` (or several, or ``None`` when it does not apply), registered with
``@rule("name")``. Adding a check is one function and one test on a recorded fact
set; rules never read the machine, so they are tested anywhere.

``gate=True`` marks rules about whether a job can run at all: ``skylift run`` and
``skylift launch`` evaluate those and stop on a ``fail`` before any worker starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from skylift.machine.facts import Facts

__all__ = ["RULES", "STATUS_ORDER", "Finding", "Rule", "Status", "Verdict", "rule"]

Status = Literal["pass", "info", "warn", "fail"]
STATUS_ORDER: dict[str, int] = {"fail": 0, "warn": 1, "info": 2, "pass": 3}
"""Worst first: how verdicts are sorted."""


@dataclass(frozen=True)
class Finding:
    """What a rule concluded: the status, why, and the exact fix (a command, a
    variable, a config key) when there is something to do."""

    status: Status
    reason: str
    fix: str | None = None


class Verdict(BaseModel):
    """One line of the report (and one object of ``verdicts`` in ``--json``)."""

    model_config = ConfigDict(extra="forbid")

    rule: str
    status: Status
    reason: str
    fix: str | None = None


Check = Callable[[Facts], "Finding | list[Finding] | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    check: Check
    gate: bool


RULES: list[Rule] = []
"""Every registered rule, in registration order (the rule modules' import order)."""


def rule(name: str, *, gate: bool = False) -> Callable[[Check], Check]:
    """Register ``check`` under ``name``; ``gate``: checked before ``run``/``launch``."""

    def register(check: Check) -> Check:
        if any(existing.name == name for existing in RULES):
            raise ValueError(f"doctor rule {name!r} is registered twice")
        RULES.append(Rule(name, check, gate))
        return check

    return register

"""The built-in doctor rules, one module per area; importing this package registers them,
and :func:`evaluate` runs them.

* :mod:`.stack`: driver, torch build and GPU architecture, precision, security fixes.
* :mod:`.resources`: /dev/shm, disk, device memory, CPUs against what the job needs.
* :mod:`.nccl`: the settings NCCL reads against the network this machine has.
"""

from __future__ import annotations

from collections.abc import Iterable

from skylift.doctor.rules import nccl, resources, stack
from skylift.doctor.verdicts import RULES, STATUS_ORDER, Rule, Verdict
from skylift.machine.facts import Facts

__all__ = ["evaluate", "nccl", "resources", "stack"]


def evaluate(facts: Facts, rules: Iterable[Rule] | None = None, *, gate_only: bool = False) -> list[Verdict]:
    """Run the rules over ``facts``; verdicts sorted worst first, then by rule order."""
    verdicts: list[Verdict] = []
    for entry in RULES if rules is None else rules:
        if gate_only and not entry.gate:
            continue
        found = entry.check(facts)
        findings = [] if found is None else found if isinstance(found, list) else [found]
        verdicts += [Verdict(rule=entry.name, status=f.status, reason=f.reason, fix=f.fix) for f in findings]
    return sorted(verdicts, key=lambda verdict: STATUS_ORDER[verdict.status])

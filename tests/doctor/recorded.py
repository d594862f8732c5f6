"""Recorded fact sets (facts/*.json): machines this suite has no access to, as data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skylift.doctor.rules import evaluate
from skylift.doctor.verdicts import Verdict
from skylift.machine.facts import Facts

FACTS_DIR = Path(__file__).parent / "facts"
NAMES = sorted(path.stem for path in FACTS_DIR.glob("*.json"))


def load_facts(name: str, **changes: Any) -> Facts:
    """The recorded set ``name`` (its ``_about`` dropped), top-level fields replaced by ``changes``."""
    raw = json.loads((FACTS_DIR / f"{name}.json").read_text())
    raw.pop("_about", None)
    raw.update(changes)
    return Facts.model_validate(raw)


def verdicts_of(facts: Facts, rule: str) -> list[Verdict]:
    return [verdict for verdict in evaluate(facts) if verdict.rule == rule]


def only(facts: Facts, rule: str) -> Verdict:
    """The single verdict ``rule`` gives on ``facts``."""
    found = verdicts_of(facts, rule)
    assert len(found) == 1, found
    return found[0]

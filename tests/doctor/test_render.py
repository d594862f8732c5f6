"""Report rendering: the stable JSON schema, the text form, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

from skylift.doctor.redact import Redactor
from skylift.doctor.render import exit_code, render_json, render_text
from skylift.doctor.rules import evaluate
from skylift.doctor.verdicts import RULES, Verdict
from skylift.machine.facts import SCHEMA_VERSION
from tests.doctor.recorded import NAMES, load_facts
from tests.doctor.schema import REPORT_KEYS, VERDICT_KEYS, field_paths

SNAPSHOT = Path(__file__).parent / "schema_v1.txt"
REDACTOR = Redactor({}, home="/nonexistent-home")


def test_schema_v1_fields_are_all_still_there():
    """Renaming or removing a field breaks readers: bump SCHEMA_VERSION and the snapshot together."""
    assert SCHEMA_VERSION == 1
    missing = set(SNAPSHOT.read_text().split()) - set(field_paths())
    assert not missing, f"fields gone from schema v1: {sorted(missing)}"


def test_json_report_has_the_documented_shape_for_every_recorded_machine():
    for name in NAMES:
        facts = load_facts(name)
        report = json.loads(render_json(facts, evaluate(facts), REDACTOR))
        assert sorted(report) == REPORT_KEYS and report["schema_version"] == 1
        assert all(sorted(verdict) == VERDICT_KEYS for verdict in report["verdicts"])
        assert report["exit_code"] == (1 if report["summary"]["fail"] else 0)
        assert sum(report["summary"].values()) == len(report["verdicts"])


def test_text_report_lists_fixes_under_failures_worst_first():
    facts = load_facts("pascal_cu130")
    text = render_text(facts, evaluate(facts), REDACTOR)
    lines = text.splitlines()
    first = next(index for index, line in enumerate(lines) if line.startswith("  FAIL"))
    assert "gpu-arch" in lines[first] and "fix: pip install torch==2.14.1" in lines[first + 1]
    assert lines[-1].endswith("exit 1") and "GTX 1080 Ti" in text


def test_exit_code_is_one_only_with_a_failure():
    assert exit_code([Verdict(rule="a", status="warn", reason="r")]) == 0
    assert exit_code([Verdict(rule="a", status="fail", reason="r")]) == 1


def test_every_rule_has_a_docstring_and_fires_on_some_recorded_machine():
    evaluate(load_facts(NAMES[0]))  # registers the rules
    fired = {verdict.rule for name in NAMES for verdict in evaluate(load_facts(name))}
    for entry in RULES:
        assert entry.check.__doc__, entry.name
    assert {entry.name for entry in RULES} - fired <= {"nccl-socket-ifname", "nccl-ib", "nccl-erdma", "cpus"}

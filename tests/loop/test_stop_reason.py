"""One mapping from why a run stopped to the label it records and the code its process
exits with (loop/agreement.py ``StopReason``), read by the Trainer, ``skylift run`` and
the framework integrations alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from skylift.errors import EXIT_FAILURE, EXIT_GUARD, EXIT_OK, EXIT_REQUEUE
from skylift.integrations.run import exit_code_for
from skylift.loop.agreement import StepAgreement, StopReason

SOURCE = Path(__file__).resolve().parents[2] / "src" / "skylift"


def test_every_stop_has_one_label_and_one_exit_code():
    assert {reason: (reason.label, reason.exit_code) for reason in StopReason} == {
        StopReason.NONE: (None, EXIT_OK),
        StopReason.SAVE_FAILED: ("checkpoint save failed", EXIT_FAILURE),
        StopReason.GUARD: ("guard", EXIT_GUARD),
        StopReason.PREEMPTED: ("preemption notice", EXIT_REQUEUE),
        StopReason.ROOT_LOST: ("checkpoint root lost", EXIT_FAILURE),
    }
    for reason in StopReason:
        assert StopReason.of_label(reason.label) is reason
        assert exit_code_for(reason.label) == reason.exit_code  # the integrations' finish()


def test_an_unknown_label_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="'budget' is not a stop reason's label .*'preemption notice'"):
        StopReason.of_label("budget")


def test_the_agreed_stop_is_the_highest_requested_and_keeps_its_exit_code():
    agreement = StepAgreement()
    agreement.request_stop(StopReason.GUARD)
    agreement.request_stop(StopReason.PREEMPTED)
    agreement.request_stop(StopReason.SAVE_FAILED)
    decision = agreement.exchange()
    assert decision.stop_code is StopReason.PREEMPTED
    assert (decision.stop_reason, decision.stop_code.exit_code) == ("preemption notice", 143)


def test_no_module_maps_a_stop_to_an_exit_code_of_its_own():
    """The guard and requeue codes are named only where StopReason defines them and where a
    process that is not a worker ends (the watchdog, the launcher and the elastic agent)."""
    allowed = {"errors.py", "loop/agreement.py", "monitor/guards.py", "launch/launcher.py", "launch/elastic.py",
               "launch/elastic_agent.py", "submit/kubernetes.py", "submit/skypilot.py",
               "cli/launch.py"}  # skylift launch: a relayed notice ends the launch 143
    users = set()
    for path in SOURCE.rglob("*.py"):
        names = {node.id for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Name)}
        names |= {alias.name for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.ImportFrom) for alias in node.names}  # fmt: skip
        if names & {"EXIT_GUARD", "EXIT_REQUEUE"}:
            users.add(path.relative_to(SOURCE).as_posix())
    assert users <= allowed, f"map a stop to its exit code with StopReason.exit_code: {sorted(users - allowed)}"

"""The docs' ``skylift submit --dry-run`` examples (docs/submit/*.md and the walk-through
docs/first-spot-job.md) print what skylift prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from skylift.cli.main import main

DOCS = Path(__file__).parents[2] / "docs" / "submit"
# The command runs to the first line end without a continuation backslash; a script job's
# ends with `-- SCRIPT ARGS`, after its --dry-run.
_EXAMPLE = re.compile(r"```console\n\$ (skylift submit (?:\\\n|[^\n])*)\n(.*?)```", re.DOTALL)
_STAMP = re.compile(r"\d{8}-\d{6}")  # the UTC time in each job name


def _examples() -> list[tuple[str, str]]:
    pages = [*sorted(DOCS.glob("*.md")), DOCS.parent / "first-spot-job.md"]
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    return [(command.replace("\\\n", " "), output) for command, output in _EXAMPLE.findall(text)
            if "--dry-run" in command.split(" -- ")[0]]


def test_the_docs_show_all_five_platforms():
    platforms = {shlex.split(command)[shlex.split(command).index("--platform") + 1] for command, _ in _examples()}
    assert platforms == {"sagemaker", "pai", "tione", "k8s", "skypilot"}


@pytest.mark.parametrize(("command", "output"), _examples(), ids=lambda value: value[:60])
def test_each_example_prints_what_the_docs_show(command, output, capsys):
    # An example that shows a refusal shows what submit writes to stderr, with exit 2.
    refused = output.startswith("skylift submit: invalid configuration:")
    assert main(shlex.split(command)[1:]) == (2 if refused else 0)
    captured = capsys.readouterr()
    printed = captured.err if refused else captured.out
    assert _STAMP.sub("STAMP", printed) == _STAMP.sub("STAMP", output)


def test_the_docs_show_a_script_job_on_every_platform():
    scripts = [shlex.split(command) for command, _ in _examples() if " -- " in command]
    assert {argv[argv.index("--platform") + 1] for argv in scripts} == {"sagemaker", "pai", "tione", "k8s", "skypilot"}


def test_the_docs_show_a_refusal_that_lists_every_missing_field():
    refusals = [output for _, output in _examples() if output.startswith("skylift submit: invalid configuration:")]
    assert any(output.count("\n  - ") >= 4 and "this would pass" in output for output in refusals)

"""The README's ``skylift submit --dry-run`` examples print what skylift prints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from skylift.cli.main import main

README = Path(__file__).parents[2] / "README.md"
_EXAMPLE = re.compile(r"```console\n\$ (skylift submit .*?--dry-run)\n(.*?)```", re.S)
_STAMP = re.compile(r"\d{8}-\d{6}")  # the UTC time in each job name


def _examples() -> list[tuple[str, str]]:
    return [(command.replace("\\\n", " "), output) for command, output in _EXAMPLE.findall(README.read_text())]


def test_the_readme_shows_all_five_platforms():
    platforms = {shlex.split(command)[shlex.split(command).index("--platform") + 1] for command, _ in _examples()}
    assert platforms == {"sagemaker", "pai", "tione", "k8s", "skypilot"}


@pytest.mark.parametrize(("command", "output"), _examples(), ids=lambda value: value[:60])
def test_each_example_prints_what_the_readme_shows(command, output, capsys):
    assert main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out
    assert _STAMP.sub("STAMP", printed) == _STAMP.sub("STAMP", output)

"""Bad input to ``skylift run`` stops with exit 2 and one message naming the field, never a
traceback, and ``--dry-run`` and ``skylift check`` refuse exactly what the run refuses
(issue 41, items 9 and 10).

Each case runs twice through the CLI's ``main`` (``cli_here``: the real entry point, in this
process, so the table stays in the fast lane), once with ``--dry-run`` and once without; the
slow lane runs the same table through ``python -m skylift`` processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli

# A run that would finish in one step, so a case the checks let through trains for seconds
# (and shows up as exit 0), not for minutes.
BASE = """\
run_dir: {run_dir}
recipe:
  dataset: digits
schedule:
  max_steps: 1
  warmup_steps: 0
monitor:
  report: false
  tensorboard: false
  progress_bar: false
"""

# Environment variables that give an object store its endpoint: unset, so oss:// has none.
ENDPOINT_VARIABLES = ("SKYLIFT_OSS_ENDPOINT_URL", "OSS_ENDPOINT", "SKYLIFT_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                      "AWS_ENDPOINT_URL")


@dataclass(frozen=True)
class Case:
    name: str
    names: str
    """What the message must name (the field, the flag or the file's problem)."""
    args: tuple[str, ...] = ()
    config: bytes | str | None = None
    """The config file's content (default: BASE); ``"<dir>"``: a folder; ``"/dev/null"``."""
    marks: tuple = field(default=())
    this_machine: bool = False
    """A refusal about this machine's devices: ``run`` and ``--dry-run`` make it, not ``check``."""


CASES = [
    Case("checkpoint root without a bucket", "checkpoint.root", ("--set", "checkpoint.root=s3://")),
    Case("checkpoint root with an empty bucket", "checkpoint.root", ("--set", "checkpoint.root=s3:///p")),
    Case("checkpoint root ftp", "checkpoint.root", ("--set", "checkpoint.root=ftp://host/p")),
    Case("checkpoint root gs", "checkpoint.root", ("--set", "checkpoint.root=gs://bucket/p")),
    Case("checkpoint endpoint not a URL", "checkpoint.endpoint_url",
         ("--set", "checkpoint.root=s3://bucket/p", "--set", "checkpoint.endpoint_url=not a url")),
    Case("checkpoint bucket name", "checkpoint.root", ("--set", "checkpoint.root=s3://Bad_Bucket!/p")),
    Case("oss without an endpoint", "checkpoint.endpoint_url", ("--set", "checkpoint.root=oss://bucket/p")),
    Case("data url without an index", "data.url", ("--set", "data.url={tmp}/no-dataset")),
    Case("data url bad scheme", "data.url", ("--set", "data.url=gs://bucket/shards")),
    Case("set value not YAML", "--set optim.lr=[", ("--set", "optim.lr=[")),
    Case("config in Latin-1", "not UTF-8", config="run_dir: {run_dir}\n# caf\xe9\n".encode("latin-1")),
    Case("config binary", "not UTF-8", config=bytes(range(128, 256)) * 4),
    Case("config a folder", "is a folder", config="<dir>"),
    Case("config /dev/null", "not a regular file", config="/dev/null"),
    Case("config duplicate key", "'schedule' is given twice", config=BASE + "schedule:\n  epochs: 2\n"),
    Case("master port out of range", "--master-port", ("--nproc", "2", "--master-port", "99999")),
    Case("grace negative", "--grace-s", ("--grace-s", "-5")),
    Case("lr infinite", "optim.lr", ("--set", "optim.lr=.inf")),
    Case("nccl on the CPU", "distributed.backend", ("--nproc", "2", "--set", "distributed.backend=nccl"),
         marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL works on this machine"),),
         this_machine=True),
]


def _arguments(case: Case, tmp_path: Path) -> list[str]:
    run_dir = tmp_path / "run"
    if case.config == "<dir>":
        config = str(tmp_path)
    elif case.config == "/dev/null":
        config = "/dev/null"
    else:
        path = tmp_path / "run.yaml"
        content = BASE if case.config is None else case.config
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.format(run_dir=run_dir))
        config = str(path)
    # --no-doctor: the doctor's own refusals are not under test (and the dry run honours it alike).
    return ["run", config, "--no-doctor", *(arg.format(tmp=tmp_path) for arg in case.args)]


def _assert_one_clear_error(result, case: Case, command: str = "run") -> list[str]:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    assert result.returncode == 2, output[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"skylift {command}: "), lines
    problems = [line for line in lines if line.startswith("  - ")]
    assert len(problems) == 1, lines  # one problem, named once: not a dump
    assert case.names in problems[0], lines
    assert len(lines) <= 3, lines  # headline, the problem, at most one line of fix
    return lines


@pytest.fixture
def no_endpoint_environment(monkeypatch):
    for name in ENDPOINT_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("no_endpoint_environment")
@pytest.mark.parametrize("case", [pytest.param(case, id=case.name, marks=case.marks) for case in CASES])
def test_bad_input_is_one_clear_error_and_the_dry_run_agrees(case, cli_here, tmp_path):
    arguments = _arguments(case, tmp_path)
    dry = _assert_one_clear_error(cli_here(*arguments, "--dry-run"), case)
    real = _assert_one_clear_error(cli_here(*arguments), case)
    assert dry == real
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.usefixtures("no_endpoint_environment")
@pytest.mark.parametrize("case", [pytest.param(case, id=case.name, marks=case.marks) for case in CASES
                                  if not case.this_machine])
def test_skylift_check_refuses_what_the_run_refuses(case, cli_here, tmp_path):
    """``skylift check CONFIG`` (with the run's flags) runs the checks the run makes before
    its first worker: a config it passes does not then fail at ``skylift run``."""
    arguments = [argument for argument in _arguments(case, tmp_path) if argument != "--no-doctor"]
    checked = _assert_one_clear_error(cli_here("check", *arguments[1:]), case, "check")
    dry = _assert_one_clear_error(cli_here(*arguments, "--no-doctor", "--dry-run"), case)
    assert [line.removeprefix("skylift check: ") for line in checked] == [
        line.removeprefix("skylift run: ") for line in dry]


def test_skylift_check_passes_a_config_the_run_takes(cli_here, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(BASE.format(run_dir=tmp_path / "run"))
    result = cli_here("check", str(path), "--nproc", "2", "--set", f"checkpoint.root={tmp_path}/checkpoints")
    assert result.returncode == 0, result.stderr
    assert "checkpoint" in result.stdout and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("no_endpoint_environment")
@pytest.mark.parametrize("case", [pytest.param(case, id=case.name, marks=case.marks) for case in CASES])
def test_bad_input_is_one_clear_error_in_a_process(case, tmp_path):
    arguments = _arguments(case, tmp_path)
    dry = _assert_one_clear_error(run_cli(*arguments, "--dry-run"), case)
    real = _assert_one_clear_error(run_cli(*arguments), case)
    assert dry == real


def test_a_bad_checkpoint_root_in_a_process_is_one_line_not_a_traceback(tmp_path):
    """The fast lane's process-boundary representative: before, the run opened the store in
    the Trainer, outside the CLI's error handling: exit 1 and a traceback."""
    case = CASES[1]
    _assert_one_clear_error(run_cli(*_arguments(case, tmp_path)), case)


def test_yaml_merge_keys_may_still_override(tmp_path):
    """Refusing duplicate keys leaves YAML's merge key alone: a key after ``<<: *anchor``
    overrides the merged one, as YAML intends."""
    from skylift.config.load import load_config

    path = tmp_path / "run.yaml"
    path.write_text("recipe:\n  base: &base {width: 8, depth: 2}\n  model_args:\n    <<: *base\n    width: 16\n")
    assert load_config(path).recipe.model_args == {"width": 16, "depth": 2}

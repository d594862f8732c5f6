"""docs/first-spot-job.md, run as written: every ``skylift`` command in its ``console``
blocks, in order, in a fresh project folder, against moto's S3 and SageMaker servers on
127.0.0.1, each printing what the page shows.

What may differ, and why: the UTC time in a job name (it is the submit's own clock), the
job records folder (this test's, shown on the page as the default ``~/.skylift/jobs``),
and the report's figures (a real run's timings and diagnosis: the page's carry their date
and version; the test holds the report's path and the names of its lines).
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from skylift.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "first-spot-job.md"
BUCKET = "my-training-bucket"
_BLOCK = re.compile(r"```console\n(.*?)```", re.DOTALL)
_STAMP = re.compile(r"\d{8}-\d{6}")


def steps() -> list[tuple[str, str]]:
    """(command, what the page shows it printing), in page order."""
    found = []
    for block in _BLOCK.findall(PAGE.read_text(encoding="utf-8")):
        command, _, output = block.partition("\n")
        while command.endswith("\\"):
            continuation, _, output = output.partition("\n")
            command = command[:-1].rstrip() + " " + continuation.strip()
        assert command.startswith("$ skylift "), command
        found.append((command[2:], output))
    return found


def test_the_page_walks_the_whole_way_in_order():
    commands = [shlex.split(command)[1:3] for command, _ in steps()]
    assert [words[0] for words in commands] == ["shard", "dockerfile", "submit", "submit", "jobs", "report"]
    assert commands[4] == ["jobs", "watch"]
    dry_run, submit = (command for command, _ in steps() if command.startswith("skylift submit"))
    assert dry_run == submit + " --dry-run" and "--platform sagemaker" in submit


def _run(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().out


@pytest.fixture
def project(tmp_path, monkeypatch, moto_server):
    moto_server.reset()
    moto_server.create_bucket(BUCKET)
    folder = tmp_path / "project"
    (folder / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "spot_s3.yaml", folder / "examples" / "spot_s3.yaml")
    monkeypatch.chdir(folder)
    # boto3's own per-service endpoint variables: the commands stay as the page shows them.
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", moto_server.endpoint_url)
    monkeypatch.setenv("SKYLIFT_JOBS_DIR", str(tmp_path / "jobs"))
    return folder


@pytest.mark.slow
def test_every_command_prints_what_the_page_shows(project, tmp_path, capsys):
    shown_job = actual_job = None
    for shown_command, shown in steps():
        command = shown_command.replace(shown_job, actual_job) if actual_job else shown_command
        argv = shlex.split(command)[1:]
        if argv[0] == "report":
            _train_the_run_folder(argv[1], capsys)
            code, printed = _run(argv, capsys)
            assert code == 0
            first, *rest = printed.splitlines()
            shown_first, *shown_rest = shown.splitlines()
            assert first == shown_first
            assert {line.split(":")[0] for line in rest} == {line.split(":")[0] for line in shown_rest}
            continue
        code, printed = _run(argv, capsys)
        assert code == 0, command
        printed = printed.replace(str(tmp_path / "jobs"), "~/.skylift/jobs")
        if argv[0] == "submit" and "--dry-run" not in argv:
            actual_job = re.search(r"job (sagemaker:\S+)", printed).group(1)
            shown_job = re.search(r"job (sagemaker:\S+)", shown).group(1)
        assert _STAMP.sub("STAMP", printed) == _STAMP.sub("STAMP", shown), command
    assert (project / "skylift-wheel" / "skylift-0.1.0-py3-none-any.whl").is_file()


def _train_the_run_folder(run_dir: str, capsys) -> None:
    """The folder SageMaker would upload: a short real run of the page's job, from the
    shards in the bucket, with its checkpoints in the same bucket."""
    argv = ["run", "examples/spot_s3.yaml", "--no-doctor", "--set", f"run_dir={run_dir}",
            "--set", f"data.url=s3://{BUCKET}/digits-shards/train",
            "--set", f"data.val_url=s3://{BUCKET}/digits-shards/val",
            "--set", "schedule.max_steps=4", "--set", "schedule.warmup_steps=1", "--set", "monitor.tensorboard=false"]
    assert _run(argv, capsys)[0] == 0

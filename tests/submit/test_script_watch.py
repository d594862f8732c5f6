"""Script jobs sent for real (the official PAI-DLC and TI-ONE SDK clients against
loopback servers): the local record ``skylift jobs watch`` reads, and the resubmission
after a spot reclaim, from ``--watch`` and from a later process alike."""

from __future__ import annotations

import json

import pytest

from skylift.cli.main import main
from tests.submit.conftest import IMAGE
from tests.submit.fake_platforms import FakeDlc, FakeTione
from tests.submit.script_jobs import REPO_ROOT, SCRIPT, SCRIPT_CONFIG


def _pai_argv(fake: FakeDlc, *extra: str) -> list[str]:
    return ["submit", "--platform", "pai", "--image", IMAGE, "--count", "2", "--spot", "--json",
            "--instance", "ecs.gn7i-c8g1.2xlarge", "--region", "cn-hangzhou",
            "--set", "checkpoint.root=oss://bucket/runs/own-loop", "--set", "submit.poll_interval_s=0.01",
            "--set", f"submit.pai.endpoint={fake.endpoint}", *extra, "--", *SCRIPT]


@pytest.fixture
def dlc(vendor_credentials):
    fake = FakeDlc(["reclaimed", "Succeeded"])
    yield fake
    fake.close()


@pytest.mark.parametrize("config", [None, SCRIPT_CONFIG])
def test_a_later_watch_resubmits_the_script_job_from_its_record(dlc, config, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the project the image holds
    assert main(_pai_argv(dlc, *(["--config", config] if config else []))) == 0
    document = json.loads(capsys.readouterr().out)
    with open(document["record"], encoding="utf-8") as stream:
        record = json.load(stream)
    assert record["script"] == list(SCRIPT)
    assert bool(record["config_path"]) is bool(config) and record["config_argument"] == (config or "")

    assert main(["jobs", "watch", document["job"]]) == 0
    out = capsys.readouterr().out
    assert "resubmitted as pai:cn-hangzhou:dlc0002 (1 of 3)" in out and "dlc0002: succeeded" in out
    first, second = dlc.created
    assert second["DisplayName"] == first["DisplayName"] + "-r1"
    assert second["UserCommand"] == first["UserCommand"]
    assert first["UserCommand"].startswith("skylift launch --checkpoint-root /mnt/skylift/checkpoints ")


def test_submit_watch_resubmits_a_reclaimed_script_job(dlc, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert main([item for item in _pai_argv(dlc, "--watch") if item != "--json"]) == 0
    out = capsys.readouterr().out
    assert "the spot capacity was reclaimed" in out and "resubmitted as pai:cn-hangzhou:dlc0002" in out
    assert [body["UserCommand"] for body in dlc.created] == [dlc.created[0]["UserCommand"]] * 2


def test_a_resubmission_needs_no_local_copy_of_the_script(vendor_credentials, capsys, tmp_path, monkeypatch):
    """The image holds the script; the watching machine may be another one."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('training')\n")
    monkeypatch.chdir(project)
    fake = FakeTione(["reclaimed", "SUCCEED"])
    try:
        argv = ["submit", "--platform", "tione", "--image", IMAGE, "--spot", "--json", "--instance",
                "TI.GN7.2XLARGE32.POST", "--region", "ap-guangzhou", "--set", "checkpoint.root=cos://b-1250000000/own",
                "--set", "submit.tione.cos_keys_from=image", "--set", f"submit.tione.endpoint={fake.endpoint}",
                "--set", "submit.poll_interval_s=0.01", "--", "python", "train.py", "--epochs", "3"]
        assert main(argv) == 0
        job = json.loads(capsys.readouterr().out)["job"]
        (project / "train.py").unlink()
        assert main(["jobs", "watch", job]) == 0
        assert "resubmitted as tione:ap-guangzhou:train-51235" in capsys.readouterr().out
        commands = [body["StartCmdInfo"]["StartCmd"] for body in fake.created]
        assert commands == [commands[0]] * 2 and commands[0].endswith("-- python train.py --epochs 3")
    finally:
        fake.close()

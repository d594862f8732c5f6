"""``skylift submit --watch`` on a loopback DLC: a general-compute spot job that DLC
reports Failed after a reclaim is resubmitted, and the new job resumes the same run."""

from __future__ import annotations

import json

from skylift.cli.main import main
from tests.submit.conftest import IMAGE
from tests.submit.fake_platforms import FakeDlc


def _argv(dlc: FakeDlc, *extra: str) -> list[str]:
    return ["submit", "examples/quickstart.yaml", "--platform", "pai", "--image", IMAGE, "--count", "2", "--spot",
            "--instance", "ecs.gn7i-c8g1.2xlarge", "--region", "cn-hangzhou", "--watch",
            "--set", "checkpoint.root=oss://bucket/runs/quick", "--set", f"submit.pai.endpoint={dlc.endpoint}",
            "--set", "submit.poll_interval_s=0.01", *extra]


def test_a_reclaimed_job_is_resubmitted_and_the_second_request_is_the_same_job(vendor_credentials, capsys):
    dlc = FakeDlc(["reclaimed", "Succeeded"])
    try:
        assert main(_argv(dlc)) == 0
    finally:
        dlc.close()
    out = capsys.readouterr().out
    assert "the spot capacity was reclaimed" in out and "resubmitted as pai:cn-hangzhou:dlc0002 (1 of 3)" in out
    assert "pai:cn-hangzhou:dlc0002: succeeded" in out
    first, second = dlc.created
    assert second["DisplayName"] == first["DisplayName"] + "-r1"
    # Same image, machines, spot terms, command and checkpoint mount: it resumes the run.
    for key in ("JobType", "JobSpecs", "UserCommand", "DataSources", "Envs", "Settings"):
        assert second[key] == first[key], key
    assert "--resume auto" in second["UserCommand"]


def test_resubmissions_stop_at_max_resubmits_and_say_how_to_resume(vendor_credentials, capsys):
    dlc = FakeDlc(["reclaimed", "reclaimed"])
    try:
        assert main(_argv(dlc, "--max-resubmits", "1")) == 1
    finally:
        dlc.close()
    out = capsys.readouterr().out
    assert len(dlc.created) == 2
    assert "max_resubmits (1) is used up" in out and "submit the same config again to resume" in out


def test_an_ordinary_failure_is_not_resubmitted(vendor_credentials, capsys):
    dlc = FakeDlc(["reclaimed"])
    try:
        argv = [item for item in _argv(dlc) if item != "--spot"]
        assert main(argv) == 1  # an on-demand job that failed: a real failure
    finally:
        dlc.close()
    assert len(dlc.created) == 1
    assert "see why with: skylift jobs logs pai:cn-hangzhou:dlc0001" in capsys.readouterr().out
    assert json.dumps(dlc.created[0]["JobSpecs"][0]["UseSpotInstance"]) == "false"


def test_a_failed_status_call_is_asked_again(vendor_credentials, capsys):
    dlc = FakeDlc(["Succeeded"])
    dlc.failing_polls = 2
    try:
        assert main(_argv(dlc)) == 0
    finally:
        dlc.close()
    out = capsys.readouterr().out
    assert out.count("no status for pai:cn-hangzhou:dlc0001") == 2
    assert "pai:cn-hangzhou:dlc0001: succeeded" in out

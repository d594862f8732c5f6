"""``skylift submit --watch`` on loopback DLC and TI-ONE servers: a spot job the platform
reports failed after a reclaim is resubmitted, and the new job resumes the same run."""

from __future__ import annotations

import json

from skylift.cli.main import main
from tests.submit.conftest import IMAGE, TENCENT_KEY_ID, TENCENT_SECRET
from tests.submit.fake_platforms import FakeDlc, FakeTione


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


# TI-ONE, through the official tencentcloud-sdk-python-tione client (TC3-signed requests
# to the loopback server). TI-ONE documents neither the reason a reclaimed SPOT task
# reports nor a restart of it: a task that ends FAILED with a reclaim reason is
# resubmitted; one that TI-ONE brings back itself (still running) is only followed.

def _tione_argv(tione: FakeTione, *extra: str) -> list[str]:
    return ["submit", "examples/quickstart.yaml", "--platform", "tione", "--image", IMAGE, "--count", "2", "--spot",
            "--instance", "TI.GN7.2XLARGE32.POST", "--region", "ap-guangzhou", "--watch",
            "--set", "checkpoint.root=cos://bucket-1250000000/runs/quick",
            "--set", "submit.tione.cos_keys_from=image", "--set", f"submit.tione.endpoint={tione.endpoint}",
            "--set", "submit.poll_interval_s=0.01", *extra]


def test_a_reclaimed_tione_task_is_resubmitted_under_a_new_name_with_the_same_checkpoint_root(
        vendor_credentials, capsys, jobs_dir):
    tione = FakeTione(["reclaimed", "SUCCEED"])
    try:
        assert main(_tione_argv(tione)) == 0
    finally:
        tione.close()
    out = capsys.readouterr().out
    assert "tione:ap-guangzhou:train-51234: failed (FAILED: 竞价实例被回收 spot instance reclaimed by the system)" in out
    assert "resubmitted as tione:ap-guangzhou:train-51235 (1 of 3)" in out
    assert "it resumes from the last checkpoint in cos://bucket-1250000000/runs/quick" in out
    assert "tione:ap-guangzhou:train-51235: succeeded (SUCCEED)" in out
    first_request, second_request = tione.creates()
    for recorded in (first_request, second_request):
        assert recorded.headers["authorization"].startswith(f"TC3-HMAC-SHA256 Credential={TENCENT_KEY_ID}/")
        assert recorded.headers["x-tc-version"] == "2021-11-11" and recorded.headers["x-tc-region"] == "ap-guangzhou"
        assert TENCENT_SECRET.encode() not in recorded.body
    first, second = first_request.json(), second_request.json()
    assert second["Name"] == first["Name"] + "-r1"
    # Same image, command (checkpoint root included), machines, spot supply, data and output.
    for key in ("ImageInfo", "StartCmdInfo", "ResourceConfigInfos", "ResourceSupplyAttribute", "TrainingMode",
                "Output", "Envs", "ChargeType"):
        assert second[key] == first[key], key
    assert "--resume auto" in second["StartCmdInfo"]["StartCmd"]
    assert "checkpoint.root=cos://bucket-1250000000/runs/quick" in second["StartCmdInfo"]["StartCmd"]
    assert second["ImageInfo"]["ImageUrl"] == IMAGE
    [record] = (jobs_dir / "tione").glob("*.json")  # a later `skylift jobs watch` follows the new task
    assert json.loads(record.read_text())["refs"] == ["tione:ap-guangzhou:train-51234", "tione:ap-guangzhou:train-51235"]


def test_a_tione_task_brought_back_by_the_platform_is_followed_not_resubmitted(vendor_credentials, capsys):
    tione = FakeTione(["relaunched"])
    try:
        assert main(_tione_argv(tione)) == 0
    finally:
        tione.close()
    out = capsys.readouterr().out
    assert len(tione.creates()) == 1
    assert "train-51234: pending (STARTING: spot instance reclaimed by the system; rescheduling)" in out
    assert "train-51234: succeeded (SUCCEED)" in out and "resubmitted" not in out

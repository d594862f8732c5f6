"""``skylift jobs watch JOB``: a later process (the laptop slept, the terminal closed)
follows a job ``skylift submit`` sent, and resubmits it after a spot reclaim from the
local record submit wrote, counting ``max_resubmits`` across processes. Loopback DLC
and TI-ONE servers, answered through the vendors' official SDK clients."""

from __future__ import annotations

import json

import pytest

from skylift.cli.main import main
from tests.submit.conftest import IMAGE, SECRETS
from tests.submit.fake_platforms import FakeDlc, FakeTione

SUCCEEDED = {"pai": "Succeeded", "tione": "SUCCEED"}


class Platform:
    """One loopback platform: its fake server and the `skylift submit` line for it."""

    def __init__(self, name: str, outcomes: list[str]) -> None:
        self.name = name
        outcomes = [SUCCEEDED[name] if outcome == "succeeded" else outcome for outcome in outcomes]
        self.fake = FakeDlc(outcomes) if name == "pai" else FakeTione(outcomes)

    def submit_argv(self, *extra: str) -> list[str]:
        common = ["submit", "examples/quickstart.yaml", "--platform", self.name, "--image", IMAGE, "--count", "2",
                  "--spot", "--json", "--set", "submit.poll_interval_s=0.01"]
        if self.name == "pai":
            return [*common, "--instance", "ecs.gn7i-c8g1.2xlarge", "--region", "cn-hangzhou",
                    "--set", "checkpoint.root=oss://bucket/runs/quick",
                    "--set", f"submit.pai.endpoint={self.fake.endpoint}", *extra]
        return [*common, "--instance", "TI.GN7.2XLARGE32.POST", "--region", "ap-guangzhou",
                "--set", "checkpoint.root=cos://bucket-1250000000/runs/quick",
                "--set", "submit.tione.cos_keys_from=image", "--set", f"submit.tione.endpoint={self.fake.endpoint}",
                *extra]

    def created(self) -> list[dict]:
        return self.fake.created

    def name_of(self, body: dict) -> str:
        return body["DisplayName" if self.name == "pai" else "Name"]

    def command_of(self, body: dict) -> str:
        return body["UserCommand"] if self.name == "pai" else body["StartCmdInfo"]["StartCmd"]

    def ref(self, number: int) -> str:
        return f"pai:cn-hangzhou:dlc{number:04d}" if self.name == "pai" else f"tione:ap-guangzhou:train-{51233 + number}"


@pytest.fixture
def platform(request, vendor_credentials):
    made: list[Platform] = []

    def make(outcomes: list[str]) -> Platform:
        made.append(Platform(request.param, outcomes))
        return made[-1]

    yield make
    for item in made:
        item.fake.close()


def _submit(capsys, target: Platform, *extra: str) -> dict:
    assert main(target.submit_argv(*extra)) == 0
    output = capsys.readouterr()
    for secret in SECRETS:
        assert secret not in output.out + output.err
    return json.loads(output.out)


def _record(document: dict) -> dict:
    with open(document["record"], encoding="utf-8") as stream:
        return json.load(stream)


@pytest.mark.parametrize("platform", ["pai", "tione"], indirect=True)
def test_a_later_watch_resubmits_a_reclaimed_job_from_its_record(platform, capsys):
    target = platform(["reclaimed", "succeeded"])
    document = _submit(capsys, target)
    assert document["job"] == target.ref(1)
    record = _record(document)
    assert record["refs"] == [target.ref(1)] and record["resubmits"] == 0
    assert record["config_argument"] == "examples/quickstart.yaml"

    assert main(["jobs", "watch", target.ref(1)]) == 0
    out = capsys.readouterr().out
    assert f"skylift jobs watch: following {target.ref(1)}; 0 of 3 resubmissions used" in out
    assert f"resubmitted as {target.ref(2)} (1 of 3)" in out
    assert f"skylift jobs watch: {target.ref(2)}: succeeded" in out
    first, second = target.created()
    assert target.name_of(second) == target.name_of(first) + "-r1"
    assert target.command_of(second) == target.command_of(first)
    assert "--resume auto" in target.command_of(second)
    record = _record(document)
    assert record["refs"] == [target.ref(1), target.ref(2)] and record["resubmits"] == 1


@pytest.mark.parametrize("platform", ["pai", "tione"], indirect=True)
def test_a_second_watch_counts_resubmissions_from_the_record(platform, capsys):
    target = platform(["reclaimed", "reclaimed", "succeeded"])
    _submit(capsys, target, "--max-resubmits", "1")

    assert main(["jobs", "watch", target.ref(1)]) == 1  # one resubmission, reclaimed again: the limit
    out = capsys.readouterr().out
    assert f"resubmitted as {target.ref(2)} (1 of 1)" in out and "submit.max_resubmits (1) is used up" in out
    assert f"allow more: skylift jobs watch {target.ref(2)} --max-resubmits 2" in out

    # A new process, given the first job: the record sends it to the newest, and counts on.
    assert main(["jobs", "watch", target.ref(1)]) == 1
    out = capsys.readouterr().out
    assert f"{target.ref(1)} was resubmitted as {target.ref(2)}; following {target.ref(2)}" in out
    assert "1 of 1 resubmissions used" in out and "submit.max_resubmits (1) is used up" in out
    assert len(target.created()) == 2

    assert main(["jobs", "watch", target.ref(2), "--max-resubmits", "2"]) == 0
    out = capsys.readouterr().out
    assert f"resubmitted as {target.ref(3)} (2 of 2)" in out and f"{target.ref(3)}: succeeded" in out
    names = [target.name_of(body) for body in target.created()]
    assert names[1:] == [names[0] + "-r1", names[0] + "-r2"]


@pytest.mark.parametrize("platform", ["pai"], indirect=True)
def test_without_a_record_the_watch_follows_status_only_and_says_why(platform, capsys, jobs_dir):
    target = platform(["reclaimed"])
    document = _submit(capsys, target)
    (jobs_dir / "pai").joinpath(document["record"].rsplit("/", 1)[1]).unlink()  # as on another machine
    argv = ["jobs", "watch", target.ref(1), "--endpoint", target.fake.endpoint, "--poll-interval-s", "0.01"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert f"following {target.ref(1)} by status only; no record of it in {jobs_dir / 'pai'}" in out
    assert "cannot be resubmitted from here" in out and "skylift submit CONFIG --platform pai" in out
    assert len(target.created()) == 1


@pytest.mark.parametrize(("key", "secret", "shown"), [
    # PAI-DLC refuses a secret-looking name's literal (test_secret_envs.py): the sentinel under another name.
    ("submit.envs.RUN_LABEL", SECRETS[0], SECRETS[0]),
    ("submit.envs.NOTE", "sk-test-123", "sk-test-123"),  # every env value is secret, whatever its name
    ("monitor.mlflow.tracking_uri", "http://user:pa55word@127.0.0.1:5000", "pa55word"),  # so is a URL's user-info
], ids=["secret-name", "neutral-name", "url-user-info"])
@pytest.mark.parametrize("platform", ["pai"], indirect=True)
def test_a_secret_override_is_not_written_and_must_be_given_again(platform, capsys, key, secret, shown):
    target = platform(["reclaimed", "succeeded"])
    document = _submit(capsys, target, "--set", f"{key}={secret}")
    with open(document["record"], encoding="utf-8") as stream:
        text = stream.read()
    assert all(value not in text for value in (*SECRETS, shown))
    assert json.loads(text)["withheld"] == [key]

    assert main(["jobs", "watch", target.ref(1)]) == 1
    out = capsys.readouterr().out
    assert f"it cannot be resubmitted: {key} had a secret value at submit" in out
    assert f"skylift jobs watch {target.ref(1)} --set {key}=VALUE" in out
    assert len(target.created()) == 1 and shown not in out

    assert main(["jobs", "watch", target.ref(1), "--set", f"{key}={secret}"]) == 0
    assert shown not in capsys.readouterr().out
    resubmitted = target.created()[1]
    if key.startswith("submit.envs."):
        assert resubmitted["Envs"][key.removeprefix("submit.envs.")] == secret
    else:
        assert secret in resubmitted["UserCommand"]


@pytest.mark.parametrize("platform", ["pai"], indirect=True)
def test_a_config_that_now_points_elsewhere_is_not_resubmitted(platform, capsys):
    target = platform(["reclaimed"])
    _submit(capsys, target)
    assert main(["jobs", "watch", target.ref(1), "--set", "checkpoint.root=oss://bucket/runs/other"]) == 1
    out = capsys.readouterr().out
    assert "now gives checkpoint.root 'oss://bucket/runs/other', and the job ran with 'oss://bucket/runs/quick'" in out
    assert f"skylift jobs watch {target.ref(1)} --set checkpoint.root=oss://bucket/runs/quick" in out
    assert len(target.created()) == 1


def test_watch_flags_with_another_action_are_refused(capsys):
    assert main(["jobs", "status", "pai:cn-hangzhou:dlc0001", "--max-resubmits", "2"]) == 2
    assert "--max-resubmits only go with watch" in capsys.readouterr().err


@pytest.mark.parametrize("platform", ["pai"], indirect=True)
def test_watch_json_prints_one_object_per_event(platform, capsys):
    target = platform(["reclaimed", "succeeded"])
    _submit(capsys, target)
    assert main(["jobs", "watch", target.ref(1), "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert events and all(set(event) == {"time", "job", "message"} for event in events)
    assert events[0]["job"] == target.ref(1)
    assert any(f"resubmitted as {target.ref(2)} (1 of 3)" in event["message"] for event in events)
    assert events[-1]["message"].endswith("succeeded (Succeeded)")


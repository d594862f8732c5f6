"""``skylift submit`` names everything a request lacks in one error, then the one
command that would pass, on all five platforms."""

from __future__ import annotations

import shlex

import pytest

from skylift.cli.main import main
from tests.submit.conftest import SECRETS

# What a new user's first try lacks on each platform, by the field each line names.
MISSING = {
    "sagemaker": (["--spot"], ["--image", "checkpoint.root", "submit.sagemaker.role_arn", "--instance"]),
    "pai": (["--spot"], ["--image", "checkpoint.root", "--instance", "--region"]),
    "tione": (["--spot"], ["--image", "checkpoint.root", "--instance", "--region", "submit.tione.cos_keys_from"]),
    "k8s": (["--spot"], ["--image", "checkpoint.root", "submit.kubernetes.cloud"]),
    "skypilot": (["--spot", "--region", "us-west-2"], ["--image", "checkpoint.root", "--region"]),
}
# The values a user puts in place of the placeholders of the command that would pass.
FILLED = {
    "<your-image>": "registry.example.com/team/skylift:1.0", "<bucket>": "bucket-1250000000", "<prefix>": "runs/q",
    "<account>": "123456789012", "<role>": "SkyliftTraining", "<instance-type>": "ml.p4d.24xlarge",
    "<ecs-spec>": "ecs.gn7i-c8g1.2xlarge", "<billing-spec>": "TI.GN7.2XLARGE32.POST", "<region>": "cn-hangzhou",
    "<ack|aks|eks|gke|tke>": "eks",  # the cloud registry lists flavours in name order
}


def _first_try(platform: str, *extra: str) -> list[str]:
    return ["submit", "examples/quickstart.yaml", "--platform", platform, *MISSING[platform][0], "--dry-run", *extra]


@pytest.mark.parametrize("platform", list(MISSING))
def test_every_missing_field_is_named_at_once_with_its_fix(platform, capsys):
    assert main(_first_try(platform)) == 2
    error = capsys.readouterr().err
    problems = [line.removeprefix("  - ") for line in error.splitlines() if line.startswith("  - ")]
    assert [problem.split(" ", 1)[0].rstrip(":") for problem in problems] == MISSING[platform][1]
    assert all("; fix: " in problem for problem in problems)
    assert "With the fixes above, this would pass:" in error


@pytest.mark.parametrize("platform", list(MISSING))
def test_the_command_that_would_pass_passes_once_its_placeholders_are_filled(platform, capsys, vendor_credentials):
    assert main(_first_try(platform)) == 2
    command = capsys.readouterr().err.rstrip().splitlines()[-1].strip()
    for placeholder, value in FILLED.items():
        command = command.replace(placeholder, value)
    argv = shlex.split(command)
    assert argv[:2] == ["skylift", "submit"] and "<" not in command
    assert main(argv[1:]) == 0, capsys.readouterr().err
    assert "nothing was sent" in capsys.readouterr().out


def test_a_wrong_store_is_replaced_in_the_command_not_repeated(capsys):
    assert main(_first_try("pai", "--set", "data.url=s3://bucket/shards", "--region", "cn-hangzhou")) == 2
    error = capsys.readouterr().err
    assert "data.url: is 's3://bucket/shards'; Alibaba Cloud PAI-DLC reads it from its own object store" in error
    command = error.rstrip().splitlines()[-1]
    assert "data.url=s3://" not in command and "--set data.url=oss://<bucket>/<prefix>" in command


def test_no_secret_reaches_the_error(capsys, vendor_credentials):
    # k8s: a secret-looking literal is allowed there (its own Secret), so the error keeps it as <value>.
    assert main(_first_try("k8s", "--set", f"submit.envs.HF_TOKEN={SECRETS[0]}",
                           "--set", f"submit.envs.NOTE={SECRETS[1]}")) == 2
    error = capsys.readouterr().err
    assert SECRETS[0] not in error and SECRETS[1] not in error and "submit.envs.HF_TOKEN=<value>" in error

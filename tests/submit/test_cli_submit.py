"""``skylift submit --dry-run [--json]`` on all five platforms, redaction, and the
errors for a missing SDK or missing credentials."""

from __future__ import annotations

import json

import pytest

from skylift.cli.main import main
from tests.submit.conftest import IMAGE, SECRETS

COMMON = ["examples/quickstart.yaml", "--image", IMAGE, "--count", "2", "--spot", "--dry-run"]
PLATFORM_ARGS = {
    "sagemaker": ["--instance", "ml.p3.16xlarge", "--region", "us-east-1", "--set", "checkpoint.root=s3://b/ckpt",
                  "--set", "submit.sagemaker.role_arn=arn:aws:iam::123456789012:role/SkyliftTraining"],
    "pai": ["--instance", "ecs.gn7i-c8g1.2xlarge", "--region", "cn-hangzhou", "--set", "checkpoint.root=oss://b/ckpt"],
    "tione": ["--instance", "TI.GN7.2XLARGE32.POST", "--region", "ap-guangzhou",
              "--set", "checkpoint.root=cos://b-1250000000/ckpt", "--set", "submit.tione.cos_keys_from=image"],
    "k8s": ["--instance", "p4d.24xlarge", "--gpus-per-node", "8", "--set", "submit.kubernetes.cloud=eks",
            "--set", "checkpoint.root=s3://b/ckpt"],
    "skypilot": ["--instance", "A100:8", "--set", "submit.skypilot.infra=aws", "--set", "checkpoint.root=s3://b/ckpt"],
}
OPERATIONS = {"sagemaker": "CreateTrainingJob", "pai": "CreateJob", "tione": "CreateTrainingTask",
              "k8s": "create TrainJob", "skypilot": "sky jobs launch"}


# Where a secret-looking name may hold a literal (a Kubernetes Secret, SkyPilot's secrets:);
# elsewhere it is refused (test_secret_envs.py), and the value goes under a neutral name.
SECRET_NAMES = {"k8s": ("HF_TOKEN", "WANDB_API_KEY"), "skypilot": ("HF_TOKEN", "WANDB_API_KEY")}


def _secret_env(platform: str, which: int, value: str) -> str:
    return f"submit.envs.{SECRET_NAMES.get(platform, ('RUN_NOTE', 'RUN_NOTE'))[which]}={value}"


def _argv(platform: str, *extra: str) -> list[str]:
    return ["submit", *COMMON, "--platform", platform, *PLATFORM_ARGS[platform], *extra]


@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_dry_run_prints_the_request_and_never_a_secret(platform, capsys, vendor_credentials):
    secret_env = _secret_env(platform, 0, SECRETS[0])
    assert main(_argv(platform, "--set", secret_env, "--set", "submit.envs.STEPS=3")) == 0
    output = capsys.readouterr()
    assert OPERATIONS[platform] in output.out and "nothing was sent" in output.out
    assert "examples/quickstart.yaml" in output.out and "auto" in output.out
    for secret in SECRETS:
        assert secret not in output.out + output.err


@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_dry_run_json_is_the_request_document(platform, capsys, vendor_credentials):
    assert main(_argv(platform, "--json", "--set", _secret_env(platform, 1, SECRETS[2]))) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["platform"] == platform and document["sent"] is False
    assert document["operation"] == OPERATIONS[platform]
    assert SECRETS[2] not in json.dumps(document)
    assert "***redacted***" in json.dumps(document)


NEUTRAL_SECRET = "sk-test-123"
URL_PASSWORD = "pa55word"


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_dry_run_hides_envs_under_any_name_and_url_user_info(platform, as_json, capsys, vendor_credentials):
    """Every submit.envs value is secret whatever its name (a short one too), and so is a
    URL's user-info in a --set the job runs with."""
    argv = _argv(platform, "--set", f"submit.envs.NOTE={NEUTRAL_SECRET}", "--set", "submit.envs.SHORT=pw1",
                 "--set", f"monitor.mlflow.tracking_uri=http://user:{URL_PASSWORD}@127.0.0.1:5000",
                 *(["--json"] if as_json else []))
    assert main(argv) == 0
    output = capsys.readouterr()
    printed = output.out + output.err
    for secret in (URL_PASSWORD, NEUTRAL_SECRET, "user:", "pw1"):
        assert secret not in printed, f"{secret!r} printed by {platform} --dry-run"
    assert "127.0.0.1:5000" in printed and "NOTE" in printed and "SHORT" in printed


def test_the_request_sent_still_carries_the_real_values():
    from skylift.submit.base import platform_module
    from tests.submit.conftest import make_job

    for platform in PLATFORM_ARGS:
        job = make_job(platform, submit={"envs": {"NOTE": NEUTRAL_SECRET}},
                       run=[f"monitor.mlflow.tracking_uri=http://user:{URL_PASSWORD}@127.0.0.1:5000"])
        request = platform_module(platform).build(job)
        sent = json.dumps([*request.extra, request.body])  # on Kubernetes the env values go in a Secret first
        assert NEUTRAL_SECRET in sent and f"user:{URL_PASSWORD}@" in sent, platform


def test_a_missing_image_names_the_flag_and_the_next_command(capsys):
    argv = [item for item in _argv("pai") if item not in ("--image", IMAGE)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--image" in error and "skylift dockerfile" in error


def test_a_local_checkpoint_root_is_refused(capsys):
    argv = [item.replace("s3://b/ckpt", "runs/local") for item in _argv("k8s")]
    assert main(argv) == 2
    assert "object store" in capsys.readouterr().err


def test_an_unknown_submit_key_is_refused_with_its_name(capsys):
    assert main(_argv("pai", "--set", "submit.pai.spot_discount=0.5")) == 2
    assert "submit.pai.spot_discount" in capsys.readouterr().err


def test_a_missing_sdk_gives_the_pip_command(monkeypatch, capsys, vendor_credentials):
    import sys

    for module in ("alibabacloud_pai_dlc20201203", "alibabacloud_pai_dlc20201203.client",
                   "alibabacloud_pai_dlc20201203.models"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: the import fails
    argv = [item for item in _argv("pai") if item != "--dry-run"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "pip install 'skylift[pai]'" in error


def test_missing_aws_credentials_say_how_to_set_them(monkeypatch, tmp_path, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", "http://127.0.0.1:9")  # never reached
    argv = [item for item in _argv("sagemaker") if item != "--dry-run"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "no AWS SageMaker credentials" in error and "aws configure" in error


def test_a_submit_section_in_the_yaml_is_read_and_flags_override_it(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(
        "run_dir: runs/yaml-job\n"
        "checkpoint:\n  root: oss://bucket/ckpt\n"
        "submit:\n  image: registry.example.com/team/skylift:1.0\n  instance_type: ecs.gn7i-c8g1.2xlarge\n"
        "  instance_count: 4\n  region: cn-hangzhou\n  pai:\n    spot_discount_limit: 0.5\n"
    )
    assert main(["submit", str(config), "--platform", "pai", "--spot", "--count", "2", "--dry-run", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)["request"]
    assert body["DisplayName"].startswith("skylift-yaml-job-")
    [spec] = body["JobSpecs"]
    assert (spec["EcsSpec"], spec["PodCount"]) == ("ecs.gn7i-c8g1.2xlarge", 2)
    assert spec["SpotSpec"]["SpotDiscountLimit"] == 0.5

"""``skylift submit --platform P [--config RUN.yaml] -- python train.py ARGS`` on the
command line: the dry run of each platform, what it refuses (every missing field at
once, keys a script does not read, a script the image would not hold, a credential in
its arguments), and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.submit.conftest import IMAGE, SECRETS
from tests.submit.script_jobs import REPO_ROOT, SCRIPT, SCRIPT_CONFIG, node_command
from tests.submit.test_cli_submit import OPERATIONS, PLATFORM_ARGS, _secret_env

SCRIPT_ARGS = ["--", *SCRIPT]


def _argv(platform: str, *extra: str) -> list[str]:
    return ["submit", "--platform", platform, "--image", IMAGE, "--count", "2", "--spot", "--dry-run",
            *PLATFORM_ARGS[platform], "--config", SCRIPT_CONFIG, *extra, *SCRIPT_ARGS]


@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_the_dry_run_shows_the_request_that_launches_the_script_and_no_secret(platform, cli_here, vendor_credentials):
    secret_env = _secret_env(platform, 0, SECRETS[0])  # HF_TOKEN where a literal one may go
    result = cli_here(*_argv(platform, "--json", "--set", secret_env))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert (document["operation"], document["sent"]) == (OPERATIONS[platform], False)
    argv, environment = node_command(platform, document["request"], document.get("applied_first", []))
    assert argv[:3] == ["skylift", "launch", "--checkpoint-root"]
    assert argv[argv.index("--"):] == SCRIPT_ARGS and "--run-dir" in argv
    assert environment["SKYLIFT_PLATFORM"] == platform and environment[secret_env.split("=")[0].removeprefix("submit.envs.")] == "***redacted***"
    for secret in SECRETS:
        assert secret not in result.stdout + result.stderr


@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_the_text_dry_run_names_the_operation_and_sends_nothing(platform, cli_here):
    result = cli_here(*_argv(platform))
    assert result.returncode == 0, result.stderr
    assert f"{OPERATIONS[platform]} -> " in result.stdout and "nothing was sent" in result.stdout
    assert "examples/own_loop.py" in result.stdout


def test_every_missing_field_is_listed_at_once_with_the_command_that_would_pass(cli_here):
    result = cli_here("submit", "--platform", "pai", "--dry-run", "--", "python", "examples/own_loop.py",
                      "--epochs", "3")
    assert result.returncode == 2
    listed = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert [line.split(":")[0] for line in listed] == [
        "  - --image (submit.image)", "  - checkpoint.root", "  - --instance (submit.instance_type)",
        "  - --region (submit.region)"]
    passing = result.stderr.rstrip().splitlines()[-1].strip()
    # The fixes are submit's, so they stand before `--`; what follows is the script's own.
    assert passing.startswith("skylift submit --platform pai --dry-run --image <your-image> ")
    assert passing.endswith(" --region <region> -- python examples/own_loop.py --epochs 3")


def test_a_config_key_the_script_does_not_read_is_refused_by_name(cli_here):
    result = cli_here(*_argv("skypilot", "--set", "optim.lr=0.1", "--set", "schedule.epochs=2"))
    assert result.returncode == 2
    assert "--set optim.lr: a script job does not read it" in result.stderr
    assert "--set schedule.epochs: a script job does not read it" in result.stderr


def test_a_script_that_is_not_in_the_project_is_refused(cli_here, tmp_path):
    missing = cli_here("submit", "--platform", "skypilot", "--dry-run", "--", "python", "nope.py")
    assert missing.returncode == 2 and "script 'nope.py' does not exist in" in missing.stderr
    outside = tmp_path / "train.py"
    outside.write_text("print('hello')\n")
    result = cli_here("submit", "--platform", "skypilot", "--dry-run", "--", "python", str(outside))
    assert result.returncode == 2 and "is outside the project" in result.stderr


def test_a_credential_among_the_scripts_arguments_is_refused_and_not_echoed(cli_here, vendor_credentials):
    flagged = cli_here(*_argv("skypilot")[:-len(SCRIPT_ARGS)], *SCRIPT_ARGS, "--hub_token", "hf_abcdefgh12345")
    assert flagged.returncode == 2
    assert "script --hub_token: looks like a credential" in flagged.stderr
    assert "hf_abcdefgh12345" not in flagged.stderr and "submit.envs.HF_TOKEN" in flagged.stderr
    pasted = cli_here(*_argv("skypilot")[:-len(SCRIPT_ARGS)], *SCRIPT_ARGS, "--note", SECRETS[0])
    assert pasted.returncode == 2 and "looks like a credential" in pasted.stderr
    assert SECRETS[0] not in pasted.stderr


def test_a_config_job_and_a_script_job_are_not_mixed(cli_here):
    both = cli_here("submit", "examples/quickstart.yaml", "--platform", "pai", "--", *SCRIPT)
    assert both.returncode == 2 and "both a config (examples/quickstart.yaml) and a script after --" in both.stderr
    assert "--config examples/quickstart.yaml" in both.stderr
    config_only = cli_here("submit", "--platform", "pai", "--config", "examples/quickstart.yaml")
    assert config_only.returncode == 2 and "--config goes with a script after --" in config_only.stderr
    neither = cli_here("submit", "--platform", "pai")
    assert neither.returncode == 2 and "nothing to submit" in neither.stderr


_WITHOUT_TORCH = """
import sys
from skylift.cli.main import main

code = main(sys.argv[1:])
heavy = sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "torchvision"))
assert not heavy, f"imported {heavy[:3]}"
sys.exit(code)
"""


def test_a_script_dry_run_does_not_import_torch():
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *_argv("k8s")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skylift launch" not in result.stdout and "- launch" in result.stdout  # the YAML list of the command


def test_the_help_shows_a_script_job(cli_here):
    result = cli_here("submit", "--help")
    assert result.returncode == 0 and "-- python train.py" in result.stdout and "--config RUN.yaml" in result.stdout

"""Secrets in the config are never written or printed in clear: every ``submit.envs`` value
(under any name) and every URL's user-info, in the run folder's ``config.yaml``, ``skylift
check``; MLflow params and W&B config are in tests/monitor/test_trackers.py, ``skylift
submit --dry-run`` and the job record in tests/submit (test_cli_submit.py, test_jobs_watch.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from skylift.cloud.redact import REDACTED, redact, redact_config

ENV_SECRET = "sk-test-123"  # under a neutral name: no name rule can catch it
URL_PASSWORD = "pa55word"
SECRET_SETS = (
    f"submit.envs.NOTE={ENV_SECRET}",
    "submit.envs.WANDB_API_KEY=wandb-key-0123456789",
    f"monitor.mlflow.tracking_uri=http://user:{URL_PASSWORD}@127.0.0.1:5000",
    f"submit.sagemaker.endpoint_url=https://alice:{URL_PASSWORD}@127.0.0.1:9/api",
)
SECRETS = (ENV_SECRET, "wandb-key-0123456789", URL_PASSWORD, "alice")


def assert_no_secret(text: str, where: str) -> None:
    found = [secret for secret in SECRETS if secret in text]
    assert not found, f"{where} holds {found} in clear"


def test_redact_config_masks_every_env_and_url_user_info_and_keeps_the_rest():
    document = {
        "data": {"url": "s3://bucket/shards", "batching": {"token_budget": 4096}},
        "monitor": {"mlflow": {"tracking_uri": "http://user:pa@ss@127.0.0.1:5000/x"}},
        "submit": {"envs": {"STEPS": "3", "NOTE": ENV_SECRET, "EMPTY": ""}, "image": f"img-{ENV_SECRET}"},
    }
    redacted = redact_config(document)
    assert redacted["submit"]["envs"] == {"STEPS": REDACTED, "NOTE": REDACTED, "EMPTY": ""}
    assert redacted["monitor"]["mlflow"]["tracking_uri"] == f"http://{REDACTED}@127.0.0.1:5000/x"
    assert redacted["submit"]["image"] == f"img-{REDACTED}"  # a long env value is hidden wherever it is
    assert redacted["data"] == document["data"]  # a field name alone (token_budget) is no secret
    assert document["submit"]["envs"]["NOTE"] == ENV_SECRET  # a copy: the run keeps its values


def test_redact_hides_envs_by_name_in_every_request_shape():
    envs = {"NOTE": "abc", "LONGER": ENV_SECRET}
    request = {"Environment": {"NOTE": "abc"}, "Envs": [{"Name": "NOTE", "Value": "abc"}],
               "env": [{"name": "NOTE", "value": "abc"}, {"name": "KEPT", "value": "abc"}],
               "run": f"skylift run --set monitor.mlflow.tracking_uri=http://u:{URL_PASSWORD}@h --note {ENV_SECRET}"}
    redacted = json.dumps(redact(request, envs=envs))
    assert '"abc"' in redacted  # KEPT is not an env of the job: its value stays
    assert redacted.count(REDACTED) == 5 and URL_PASSWORD not in redacted and ENV_SECRET not in redacted


@pytest.mark.parametrize("as_json", [False, True], ids=["yaml", "json"])
def test_check_prints_no_secret(cli_here, as_json):
    sets = [item for setting in SECRET_SETS for item in ("--set", setting)]
    result = cli_here("check", "examples/quickstart.yaml", *sets, *(["--json"] if as_json else []))
    assert result.returncode == 0, result.stderr
    assert_no_secret(result.stdout + result.stderr, "skylift check")
    printed = json.loads(result.stdout) if as_json else yaml.safe_load(result.stdout)
    assert printed["submit"]["envs"] == {"NOTE": REDACTED, "WANDB_API_KEY": REDACTED}
    assert printed["monitor"]["mlflow"]["tracking_uri"] == f"http://{REDACTED}@127.0.0.1:5000"


def test_the_run_folder_config_holds_no_secret_and_still_loads(cli_here, tmp_path):
    from skylift.config.load import load_config
    from tests.checkpoint.runs import lean_train_here

    run_dir = tmp_path / "run"
    result = lean_train_here(cli_here, run_dir, "schedule.max_steps=2", "schedule.warmup_steps=0",
                             "checkpoint.enabled=false", *SECRET_SETS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_no_secret((run_dir / "config.yaml").read_text(), "RUN_DIR/config.yaml")
    for path in run_dir.rglob("*"):  # nothing else in the run folder either
        if path.is_file() and path.suffix in (".yaml", ".json", ".jsonl", ".txt", ".html"):
            assert_no_secret(path.read_text(errors="replace"), str(path.relative_to(run_dir)))
    assert load_config(run_dir / "config.yaml").submit.envs["NOTE"] == REDACTED  # export and plan still read it

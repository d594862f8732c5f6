"""SkyPilot task YAML against SkyPilot's task and resources schema (the part skylift
writes, vendored as test data); SkyPilot itself is a 460 MB install."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from skylift.submit import skypilot
from tests.submit.conftest import make_job

SCHEMA = json.loads((Path(__file__).parent / "data" / "skypilot_task_schema.json").read_text())


def _validate(task: dict) -> None:
    import jsonschema

    jsonschema.Draft202012Validator(SCHEMA).validate(task)


def test_the_task_yaml_matches_the_schema_and_asks_for_a_recoverable_spot_job():
    options = {"skypilot": {"infra": "aws/us-east-1", "disk_size_gib": 200}}
    request = skypilot.build(make_job("skypilot", submit=options))
    task = yaml.safe_load(skypilot.task_yaml(request))
    _validate(task)
    assert task["num_nodes"] == 2
    resources = task["resources"]
    assert resources["accelerators"] == "A100:8"
    assert resources["use_spot"] is True
    assert resources["image_id"] == "docker:registry.example.com/team/skylift:1.0"
    assert resources["job_recovery"]["recover_on_exit_codes"] == [143]
    assert task["run"].startswith("skylift run examples/quickstart.yaml --resume auto")
    assert "checkpoint.root=s3://bucket-1250000000/runs/quick" in task["run"]


def test_an_instance_type_goes_to_instance_type():
    task = skypilot.build(make_job("skypilot", submit={"instance_type": "p4d.24xlarge"})).body
    _validate(task)
    assert task["resources"]["instance_type"] == "p4d.24xlarge" and "accelerators" not in task["resources"]


def test_the_schema_rejects_a_misspelled_key():
    import jsonschema

    task = skypilot.build(make_job("skypilot")).body
    task["resources"]["use_spott"] = True
    with pytest.raises(jsonschema.ValidationError, match="use_spott"):
        _validate(task)


def test_region_outside_infra_is_refused_with_the_fix():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match="submit.skypilot.infra=aws/us-west-2"):
        skypilot.build(make_job("skypilot", submit={"region": "us-west-2"}))


@pytest.mark.parametrize("infra", ["amazon", "aws/", "gcp/us-central1/a/b"])
def test_an_infra_skypilot_would_refuse_fails_naming_the_field(infra):
    from skylift.errors import SkyliftConfigError

    with pytest.raises((SkyliftConfigError, ValueError), match="submit.skypilot.infra|not a SkyPilot infra"):
        make_job("skypilot", submit={"skypilot": {"infra": infra}})


def test_the_torch_free_jobs_of_make_test_skypilot_are_the_ones_make_job_builds():
    from tests.submit.skypilot_jobs import VARIANTS, torch_free_job

    for variant, submit in VARIANTS.items():
        assert skypilot.build(make_job("skypilot", submit=submit)).body == skypilot.build(torch_free_job(submit)).body, variant


def test_submit_envs_go_in_the_tasks_secrets_not_its_envs():
    envs = {"HF_TOKEN": "hf-sentinel-value-0001", "NOTE": "pw1"}
    task = yaml.safe_load(skypilot.task_yaml(skypilot.build(make_job("skypilot", submit={"envs": envs}))))
    _validate(task)
    assert task["envs"] == {"SKYLIFT_PLATFORM": "skypilot"}
    assert task["secrets"] == envs
    assert "secrets" not in skypilot.build(make_job("skypilot")).body  # nothing secret: no section


def test_an_env_name_a_shell_cannot_set_is_refused_by_name():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match=r"submit\.envs\.2FA: a SkyPilot environment variable's name"):
        skypilot.build(make_job("skypilot", submit={"envs": {"2FA": "x"}}))

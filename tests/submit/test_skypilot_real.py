"""SkyPilot's own code on the task YAML skylift writes: its task and resources schemas,
``sky.Task.from_yaml_config``, the managed-jobs recovery strategy, and the vendored
subset (data/skypilot_task_schema.json, used by test_skypilot.py) against the real one.

Skipped where SkyPilot is not installed (``pip install skypilot``, a 460 MB install whose
``click<8.2`` pin does not fit the ``test`` extra). Offline: SkyPilot downloads its cloud
catalogs (raw.githubusercontent.com) only when a resource's CPUs, memory or an instance
type's accelerators are read, which nothing here does, and the loopback guard is installed
here too, for a run without the suite's conftest (which needs torch):

    PYTHONPATH=src:. pytest --noconftest tests/submit/test_skypilot_real.py
"""

from __future__ import annotations

import atexit
import copy
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from skylift.submit import skypilot
from tests.submit.conftest import IMAGE
from tests.submit.skypilot_jobs import VARIANTS
from tests.submit.skypilot_jobs import torch_free_job as _job

if importlib.util.find_spec("sky") is None:
    if os.environ.get("SKYLIFT_REQUIRE_SKYPILOT"):  # `make test-skypilot`: a skip would hide a broken install
        raise RuntimeError("SKYLIFT_REQUIRE_SKYPILOT is set but SkyPilot is not importable")
    pytest.skip("SkyPilot is not installed (make test-skypilot installs it apart)", allow_module_level=True)

# SkyPilot writes ~/.sky (user hash, lock and catalog folders) on import and keeps the paths:
# import it under a home of its own.
_SKY_HOME = tempfile.mkdtemp(prefix="skylift-sky-home-")
atexit.register(shutil.rmtree, _SKY_HOME, ignore_errors=True)
with pytest.MonkeyPatch.context() as _patch:
    _patch.setenv("HOME", _SKY_HOME)
    sky = pytest.importorskip("sky")
    from sky.jobs import recovery_strategy
    from sky.utils import common_utils, registry, schemas

NETGUARD_DIR = Path(__file__).resolve().parents[1] / "netguard"
if str(NETGUARD_DIR) not in sys.path:
    sys.path.insert(0, str(NETGUARD_DIR))
import skylift_netguard  # after sys.path names its folder

GUARD = skylift_netguard.install()  # the suite's own guard when tests/conftest.py installed it
VENDORED = json.loads((Path(__file__).parent / "data" / "skypilot_task_schema.json").read_text())
@pytest.fixture(autouse=True)
def _offline():
    seen = len(GUARD.refusals)
    yield
    assert GUARD.refusals[seen:] == [], "SkyPilot reached past loopback"


def _task(variant: str) -> dict:
    return yaml.safe_load(skypilot.task_yaml(skypilot.build(_job(VARIANTS[variant]))))


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_task_yaml_passes_skypilots_own_task_and_resources_schemas(variant):
    task = _task(variant)
    # The task schema leaves resources open ({"type": "object"}); Resources.from_yaml_config
    # checks them against the resources schema, as here.
    assert schemas.get_task_schema()["properties"]["resources"] == {"type": "object"}
    common_utils.validate_schema(task, schemas.get_task_schema(), "Invalid task YAML: ")
    common_utils.validate_schema(task["resources"], schemas.get_resources_schema(), "Invalid resources YAML: ")


@pytest.mark.parametrize("variant", VARIANTS)
def test_sky_task_from_yaml_config_reads_what_skylift_meant(variant):
    task = _task(variant)
    parsed = sky.Task.from_yaml_config(copy.deepcopy(task))  # it pops the keys it reads
    assert parsed.name == task["name"] == "skylift-quickstart-20261201-080000"
    assert parsed.num_nodes == 2
    assert parsed.setup == "skylift --version"
    assert parsed.run == task["run"] and parsed.run.startswith("skylift run examples/quickstart.yaml --resume auto")
    assert parsed.envs == {"SKYLIFT_PLATFORM": "skypilot"}
    assert sky.task.get_plaintext_secrets(parsed.secrets) == VARIANTS[variant].get("envs", {})
    (resources,) = parsed.resources
    assert resources.use_spot is True
    assert list(resources.image_id.values()) == [f"docker:{IMAGE}"]  # keyed by region, None without one
    assert resources.job_recovery == task["resources"]["job_recovery"]
    assert resources.job_recovery["recover_on_exit_codes"] == [143]
    wanted = VARIANTS[variant]
    instance = wanted.get("instance_type", "A100:8")
    if ":" in instance:
        name, count = instance.split(":")
        assert resources.accelerators == {name: int(count)} and resources.instance_type is None
    else:  # reading .accelerators of an instance type would download the catalog
        assert resources.instance_type == instance
    infra = wanted.get("skypilot", {}).get("infra")
    cloud, _, region = (infra or "").partition("/")
    if not infra:
        assert resources.cloud is None
    else:
        assert str(resources.cloud).lower() == {"k8s": "kubernetes"}.get(cloud, cloud)
        assert resources.region == (region or None)
    if disk := wanted.get("skypilot", {}).get("disk_size_gib"):
        assert resources.disk_size == disk


def test_skypilot_stores_the_managed_jobs_task_with_the_submit_envs_redacted(tmp_path):
    """``sky jobs launch`` keeps the user's task YAML (``dump_dag_to_yaml_str(...,
    use_user_specified_yaml=True)`` in sky/jobs/server/core.py) for the jobs table and the
    dashboard: a value under ``envs:`` would be kept in clear, one under ``secrets:`` is not."""
    from sky.utils import dag_utils

    envs = {"HF_TOKEN": "hf-sentinel-value-0001", "NOTE": "pw1"}
    path = tmp_path / "task.yaml"
    path.write_text(skypilot.task_yaml(skypilot.build(_job({"envs": envs}))))  # the file `send` launches
    stored = dag_utils.dump_dag_to_yaml_str(dag_utils.load_chain_dag_from_yaml(str(path)),
                                            use_user_specified_yaml=True)
    for value in envs.values():
        assert value not in stored
    assert "HF_TOKEN: <redacted>" in stored


def test_skypilot_reads_a_script_jobs_task_as_written():
    from tests.submit.skypilot_jobs import torch_free_script_job

    task = yaml.safe_load(skypilot.task_yaml(skypilot.build(torch_free_script_job())))
    common_utils.validate_schema(task, schemas.get_task_schema(), "Invalid task YAML: ")
    common_utils.validate_schema(task["resources"], schemas.get_resources_schema(), "Invalid resources YAML: ")
    parsed = sky.Task.from_yaml_config(copy.deepcopy(task))
    assert parsed.run == task["run"]
    assert parsed.run.startswith("skylift launch --checkpoint-root s3://bucket-1250000000/runs/own-loop ")
    assert parsed.run.endswith(" -- python examples/own_loop.py examples/own_loop.yaml")


def test_skypilot_refuses_a_misspelled_resources_key():
    task = _task("accelerators")
    task["resources"]["use_spott"] = True
    with pytest.raises(ValueError, match="use_spott"):
        sky.Task.from_yaml_config(task)


def test_the_recovery_strategy_exists_and_exit_143_relaunches_without_using_a_restart():
    recovery = _task("accelerators")["resources"]["job_recovery"]
    executor_class = registry.JOBS_RECOVERY_STRATEGY_REGISTRY.from_str(recovery["strategy"])
    assert executor_class is recovery_strategy.EagerFailoverStrategyExecutor

    def executor():
        return SimpleNamespace(recover_on_exit_codes=recovery["recover_on_exit_codes"], restart_cnt_on_failure=0,
                               max_restarts_on_errors=recovery["max_restarts_on_errors"])

    should_restart = recovery_strategy.StrategyExecutor.should_restart_on_failure
    assert recovery["max_restarts_on_errors"] == 0
    assert should_restart(executor(), exit_codes=[143]) is True  # saved after SIGTERM: relaunch
    assert should_restart(executor(), exit_codes=[1]) is False  # a real failure, no restarts left


def _plain(schema):
    """A schema without what does not constrain: descriptions and empty ``required``."""
    if isinstance(schema, dict):
        return {key: _plain(value) for key, value in schema.items()
                if key not in ("description", "$comment") and not (key == "required" and value == [])}
    if isinstance(schema, list):
        return [_plain(item) for item in schema]
    return schema


def _closed_job_recovery(schema: dict) -> tuple[dict, object]:
    """The job_recovery schema with its object branch's additionalProperties taken out, and that value."""
    schema = json.loads(json.dumps(schema))
    (branch,) = [item for item in schema["anyOf"] if item.get("type") == "object"]
    return schema, branch.pop("additionalProperties", None)


def test_the_vendored_subset_agrees_with_skypilot_on_every_key_skylift_writes():
    real_task, real_resources = schemas.get_task_schema(), schemas.get_resources_schema()
    tasks = [_task(variant) for variant in VARIANTS]
    task_keys = sorted({key for task in tasks for key in task} - {"resources"})
    resource_keys = sorted({key for task in tasks for key in task["resources"]})
    assert VENDORED["additionalProperties"] is real_task["additionalProperties"] is False
    vendored_resources = VENDORED["properties"]["resources"]
    assert vendored_resources["additionalProperties"] is real_resources["additionalProperties"] is False
    differences = []
    for key in task_keys:
        if _plain(VENDORED["properties"][key]) != _plain(real_task["properties"][key]):
            differences.append(f"task.{key}: vendored {json.dumps(VENDORED['properties'][key])} "
                               f"!= SkyPilot {json.dumps(real_task['properties'][key])}")
    for key in resource_keys:
        mine, real = _plain(vendored_resources["properties"][key]), _plain(real_resources["properties"][key])
        if key == "job_recovery":
            # Closed in the vendored copy on purpose; the client leaves it open for plugins.
            (mine, closed), (real, _) = _closed_job_recovery(mine), _closed_job_recovery(real)
            assert closed is False
        if mine != real:
            differences.append(f"resources.{key}: vendored {json.dumps(mine)} != SkyPilot {json.dumps(real)}")
    assert not differences, "\n".join([f"SkyPilot {sky.__version__}:", *differences])

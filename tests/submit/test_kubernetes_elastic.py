"""Elastic jobs (``distributed.nodes``) on the platforms: the v1 PyTorchJob's ``elasticPolicy``
against the Training Operator's own CRD schema (vendored in ``data/``, with its commit), the
TrainJob's ``-elastic`` runtime against the Kubernetes and Trainer API schemas, the in-pod
topology from the variables the operator sets, and the dry-run line on every platform."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skylift.cli.main import main
from skylift.errors import SkyliftConfigError
from skylift.submit import kubernetes
from skylift.submit.environment import detect_platform_topology
from tests.submit.conftest import make_job
from tests.submit.test_cli_submit import PLATFORM_ARGS, _argv
from tests.submit.test_kubernetes import POD_FAILURE_ACTIONS, openapi_problems, pydantic_unknown_keys

ELASTIC = ["distributed.nodes={min: 1, max: 3}"]
CRD_SCHEMA = Path(__file__).parent / "data" / "kubeflow_pytorchjob_v1_schema.json"
# kubeflow/training-operator release-1.9 pkg/apis/kubeflow.org/v1/pytorch_types.go:
# PyTorchJobDefaultPort, the container port the defaulting webhook adds as "pytorchjob-port".
OPERATOR_DEFAULT_PORT = 23456
# kubeflow/trainer pkg/constants/constants.go TorchRunReservedEnvNames: the TrainJob webhook
# refuses these in spec.trainer.env ("must not have reserved envs").
TRAINER_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


def crd_problems(value: object) -> list[str]:
    """Schema errors, plus keys the structural schema does not define (it allows them silently)."""
    import jsonschema

    schema = json.loads(CRD_SCHEMA.read_text())
    found = [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"
             for e in jsonschema.Draft7Validator(schema).iter_errors(value)]
    return sorted(found + _unknown_keys(schema, value, ""))


def _unknown_keys(schema: dict, value: object, path: str) -> list[str]:
    if isinstance(value, list) and "items" in schema:
        return [p for index, item in enumerate(value) for p in _unknown_keys(schema["items"], item, f"{path}/{index}")]
    if not isinstance(value, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    properties, extra = schema.get("properties"), schema.get("additionalProperties")
    problems = []
    for key, item in value.items():
        if properties is not None and key in properties:
            problems += _unknown_keys(properties[key], item, f"{path}/{key}")
        elif isinstance(extra, dict):
            problems += _unknown_keys(extra, item, f"{path}/{key}")
        elif properties is not None:
            problems.append(f"{path}/{key}: not in the CRD")
    return problems


def _pytorch_job(run=ELASTIC, **submit):
    return kubernetes.build(make_job("k8s", run=run, submit={"kubernetes": {"api": "pytorchjob", "cloud": "eks"},
                                                            **submit}))


def test_the_elastic_pytorch_job_matches_the_operators_crd_and_models():
    body = _pytorch_job().body
    assert crd_problems(body) == []
    assert openapi_problems("KubeflowOrgV1PyTorchJob", body) == []
    policy = body["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["rdzvBackend"]) == (1, 3, "c10d")
    assert policy["maxRestarts"] == 3  # distributed.nodes.max_failures' default
    assert policy["rdzvId"] == body["metadata"]["name"]
    # The operator's webhook requires a Worker spec with an elastic policy; a Master would
    # take a rank of its own outside the rendezvous.
    specs = body["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Worker"] and specs["Worker"]["replicas"] == 2  # make_job's instance_count


def test_the_crd_walk_catches_a_misspelled_elastic_field():
    body = _pytorch_job().body
    body["spec"]["elasticPolicy"]["minReplica"] = body["spec"]["elasticPolicy"].pop("minReplicas")
    body["spec"]["elasticPolicy"]["maxReplicas"] = "3"
    assert crd_problems(body) == ["/spec/elasticPolicy/maxReplicas: '3' is not of type 'integer'",
                                  "/spec/elasticPolicy/minReplica: not in the CRD"]


def test_a_fixed_pytorch_job_is_unchanged_and_still_matches_the_crd():
    body = _pytorch_job(run=[]).body
    assert "elasticPolicy" not in body["spec"]
    assert set(body["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert crd_problems(body) == []


def test_the_pod_reads_the_operators_elastic_variables_as_its_rendezvous():
    body = _pytorch_job().body
    name, policy = body["metadata"]["name"], body["spec"]["elasticPolicy"]
    # What release-1.9's pkg/controller.v1/pytorch/elastic.go sets from this job: no master,
    # no rank; PET_NNODES "min:max" and the endpoint <job>-worker-0:<pytorchjob-port>.
    environ = {"PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
               "PET_RDZV_ENDPOINT": f"{name}-worker-0:{OPERATOR_DEFAULT_PORT}", "PET_RDZV_BACKEND": "c10d",
               "PET_RDZV_ID": policy["rdzvId"], "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
               "PET_NPROC_PER_NODE": body["spec"]["nprocPerNode"]}
    found = detect_platform_topology(environ, filesystem_root=Path("/nonexistent"))
    assert found.elastic_nodes == (policy["minReplicas"], policy["maxReplicas"])
    assert (found.master_addr, found.master_port) == (f"{name}-worker-0", OPERATOR_DEFAULT_PORT)
    assert (found.nnodes, found.nproc) == (policy["maxReplicas"], int(body["spec"]["nprocPerNode"]))
    # The config inside the image is the one submitted; the command adds nothing that fixes the size.
    command = body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes" not in command and "--node-rank" not in command


def test_a_malformed_node_range_from_the_platform_names_the_variable():
    with pytest.raises(SkyliftConfigError, match="PET_NNODES='1:x'"):
        detect_platform_topology({"PET_NNODES": "1:x"}, filesystem_root=Path("/nonexistent"))


def test_the_elastic_train_job_recreates_a_lost_pod_instead_of_the_jobset():
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

    from tests.submit.test_kubernetes_schemas import problems

    request = kubernetes.build(make_job("k8s", run=ELASTIC))
    [runtime] = request.extra
    assert runtime["metadata"]["name"] == request.body["spec"]["runtimeRef"]["name"] == "skylift-torch-spot-eks-elastic"
    template = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]
    assert problems("jobtemplatespec-batch-v1.json", template) == []
    rules = template["spec"]["podFailurePolicy"]["rules"]
    assert [rule["action"] for rule in rules] == ["Ignore", "Ignore"]
    # Nothing is left for the JobSet to restart on: only a real error fails it.
    assert [rule["action"] for rule in runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"]] == ["FailJobSet"]
    assert {rule["action"] for rule in rules} <= POD_FAILURE_ACTIONS
    assert pydantic_unknown_keys(TrainerV1alpha1TrainJob, request.body) == []
    assert pydantic_unknown_keys(TrainerV1alpha1ClusterTrainingRuntime, runtime) == []
    assert not {env["name"] for env in request.body["spec"]["trainer"]["env"]} & TRAINER_RESERVED_ENV
    fixed = kubernetes.build(make_job("k8s")).extra[0]
    fixed_rules = fixed["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]
    assert [rule["action"] for rule in fixed_rules["rules"]] == ["FailJob", "FailJob"]


@pytest.mark.parametrize("count", [4, 9])
def test_a_node_count_outside_the_range_is_refused_with_the_fix(count):
    with pytest.raises(SkyliftConfigError) as error:
        kubernetes.build(make_job("k8s", run=ELASTIC, submit={"instance_count": count}))
    assert f"submit.instance_count: {count} nodes" in str(error.value)
    assert "outside distributed.nodes [1, 3]" in str(error.value) and "submit.instance_count=3" in str(error.value)


@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_the_dry_run_says_which_platform_keeps_an_elastic_job_running(platform, capsys, vendor_credentials):
    assert main(_argv(platform, "--set", ELASTIC[0])) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "elastic:" in line]
    assert len(lines) == 1
    if platform == "k8s":  # the TrainJob, the default api
        assert "elastic: yes, inside the TrainJob" in lines[0] and "--nnodes 1:3" in lines[0]
    else:
        assert f"elastic: no, {platform} relaunches whole jobs" in lines[0] and "[1, 3]" in lines[0]
    assert main(_argv(platform)) == 0
    assert "elastic:" not in capsys.readouterr().out  # a fixed job: no line


def test_the_dry_run_json_carries_the_note(capsys, vendor_credentials):
    assert main(_argv("skypilot", "--json", "--set", ELASTIC[0])) == 0
    [note] = json.loads(capsys.readouterr().out)["notes"]
    assert note.startswith("elastic: no, skypilot relaunches whole jobs") and "#3907" in note


def test_the_elastic_platforms_page_shows_what_submit_prints(capsys):
    import shlex

    from tests.submit.test_readme import _EXAMPLE, _STAMP

    page = Path(__file__).parents[2] / "docs" / "elastic-platforms.md"
    examples = [(command.replace("\\\n", " "), output) for command, output in _EXAMPLE.findall(page.read_text())]
    assert len(examples) == 2  # the PyTorchJob and SkyPilot
    for command, output in examples:
        assert main(shlex.split(command)[1:]) == 0
        assert _STAMP.sub("STAMP", capsys.readouterr().out) == _STAMP.sub("STAMP", output)


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_the_pods_skylift_run_starts_an_elastic_rendezvous_at_the_platforms_endpoint(api, monkeypatch, tmp_path):
    """What `skylift run` makes of each API's pod environment with the job's distributed.nodes."""
    import argparse

    from skylift.cli.options import add_topology_arguments, topology_from
    from skylift.submit import environment

    job = make_job("k8s", run=ELASTIC, submit={"kubernetes": {"api": api, "cloud": "eks"}})
    name = job.name
    if api == "pytorchjob":  # release-1.9 elastic.go, as above
        environ = {"PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": f"{name}-worker-0:{OPERATOR_DEFAULT_PORT}",
                   "PET_RDZV_BACKEND": "c10d", "PET_NPROC_PER_NODE": "8"}
        endpoint = (f"{name}-worker-0", OPERATOR_DEFAULT_PORT)
    else:  # kubeflow/trainer torch.go: numNodes, the completion index, node 0's address and port 29500
        environ = {"PET_NNODES": str(job.options.instance_count), "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "8",
                   "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}
        endpoint = (f"{name}-node-0-0.{name}", 29500)
    monkeypatch.setattr(environment, "FILESYSTEM_ROOT", tmp_path)  # no SageMaker resource config under it
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    topology = topology_from(parser.parse_args([]), nodes=job.nodes)
    assert (topology.elastic.min, topology.elastic.max) == (1, 3)
    assert (topology.master_addr, topology.master_port) == endpoint
    assert (topology.nnodes, topology.nproc) == (3, 8)
    from skylift.launch.elastic import elastic_torchrun_arguments

    conf = next(arg for arg in elastic_torchrun_arguments(topology, ["train"], module=True, port=endpoint[1])
                if arg.startswith("--rdzv-conf="))
    # A PyTorchJob pod has no node rank: torch picks the host by the endpoint's name (worker-0),
    # where is_host=true on every pod would make each one serve a store of its own.
    assert ("is_host" in conf) == (api == "trainjob")
    if api == "trainjob":
        assert "is_host=false" in conf  # PET_NODE_RANK 1


def test_an_elastic_pytorchjob_pod_is_elastic_without_distributed_nodes(monkeypatch, tmp_path):
    """The operator's PET_NNODES=MIN:MAX alone makes the pod elastic, named by PET_RDZV_ID."""
    import argparse

    from skylift.cli.options import add_topology_arguments, topology_from
    from skylift.launch.elastic import rendezvous_id
    from skylift.submit import environment

    monkeypatch.setattr(environment, "FILESYSTEM_ROOT", tmp_path)  # no SageMaker resource config under it
    monkeypatch.delenv("SKYLIFT_JOB_ID", raising=False)
    for key, value in {"PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": f"job-worker-0:{OPERATOR_DEFAULT_PORT}",
                       "PET_RDZV_ID": "job", "PET_NPROC_PER_NODE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    topology = topology_from(parser.parse_args([]))
    assert (topology.elastic.min, topology.elastic.max, topology.nnodes) == (2, 4, 4)
    assert topology.rendezvous_host_by_name
    assert rendezvous_id("job-worker-0", OPERATOR_DEFAULT_PORT) == rendezvous_id("elsewhere", 1)  # PET_RDZV_ID names it

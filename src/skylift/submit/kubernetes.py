"""Kubernetes: a Kubeflow Trainer v2 ``TrainJob`` on a skylift ``ClusterTrainingRuntime``,
or a Training Operator v1 ``PyTorchJob``, sent with the ``kubernetes`` client (extra ``k8s``).

Restart-on-preemption: a worker that saves and exits 143 after SIGTERM, or a pod that
is evicted by a node disruption (``DisruptionTarget``), fails its Job through the
``podFailurePolicy``; the JobSet ``failurePolicy`` then restarts the whole JobSet (up
to ``max_restarts``) and ``skylift run --resume auto`` continues from the checkpoint.
Other failures (exit 1-127) fail the job at once. The v1 ``PyTorchJob`` gets the same
contract from ``restartPolicy: ExitCode`` (128-255 retried, 1-127 permanent).

An elastic job (``distributed.nodes``) keeps training when one pod goes: the v1
``PyTorchJob`` gets an ``elasticPolicy`` (Worker pods only, as the operator requires;
its rendezvous is ``<job>-worker-0``), and a TrainJob runs on an ``-elastic`` runtime
whose ``podFailurePolicy`` recreates the lost pod (``Ignore``) instead of failing its Job,
which would restart the whole JobSet (:mod:`skylift.submit.elastic` says which is which).

The job's ``submit.envs`` travel in a ``Secret`` (``<job>-envs``, created before the job,
then owned by it so that deleting the job deletes it) that the containers read through
``valueFrom.secretKeyRef``: no value sits in the job's manifest, which anyone who may read
the job (``kubectl get trainjob -o yaml``) sees; the dry run prints the Secret redacted.
``submit.envs.NAME=secret:SECRET/KEY`` refers to an existing Secret instead, and a script
job's ``--input`` is a PVC or hostPath volume (:mod:`skylift.submit.kubernetes_inputs`).

Spot scheduling per managed cluster: EKS with Karpenter (``karpenter.sh/capacity-type``),
GKE (``cloud.google.com/gke-spot``), AKS (``kubernetes.azure.com/scalesetpriority``,
with the taint AKS puts on spot pools). ACK and TKE publish no standard spot node
label: label and taint the spot node pool ``skylift.io/capacity-type=spot``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skylift.cloud.redact import redact
from skylift.cloud.vendors import kubernetes_flavours
from skylift.config.distributed import ElasticNodes
from skylift.config.script_environment import PLATFORM_VARIABLE
from skylift.config.submit import SubmitConfig
from skylift.errors import EXIT_REQUEUE, SkyliftConfigError
from skylift.submit import elastic, kubernetes_inputs
from skylift.submit.base import (
    JobRef,
    JobState,
    JobStatus,
    Platform,
    PlatformTopology,
    SubmitRequest,
    import_sdk,
    vendor_errors,
)
from skylift.submit.checks import Problem, request_problems, require
from skylift.submit.environment import integer, optional_integer
from skylift.submit.inputs import input_notes
from skylift.submit.spec import JobSpec

__all__ = ["build", "envs_secret_name", "logs", "problems", "send", "status", "stop"]

NAME = "k8s"
TRAINER_API = ("trainer.kubeflow.org", "v1alpha1")
TRAINING_OPERATOR_API = ("kubeflow.org", "v1")

# A job's conditions (TrainJob and PyTorchJob), most telling first.
_CONDITION_STATES: tuple[tuple[str, JobState], ...] = (
    ("Complete", "succeeded"), ("Succeeded", "succeeded"), ("Failed", "failed"),
    ("Suspended", "stopped"), ("Running", "running"), ("Restarting", "running"))
# What the API server accepts as a key of a Secret's data (the variable's name here).
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def problems(options: SubmitConfig, checkpoint_root: str | None) -> list[Problem]:
    """What Kubernetes needs beyond the common checks (:mod:`skylift.submit.checks`)."""
    found = []
    if options.spot and options.kubernetes.cloud == "none":
        flavours = sorted(kubernetes_flavours())
        found.append(Problem("submit.kubernetes.cloud", "--spot on Kubernetes needs the cluster flavour for its spot "
                             f"node labels ({', '.join(flavours[:-1])} or {flavours[-1]})",
                             ("--set", f"submit.kubernetes.cloud=<{'|'.join(flavours)}>")))
    for name in options.envs:
        if not _SECRET_KEY.fullmatch(name):
            # The value goes in a Secret under this name, and a Secret key allows no other characters.
            found.append(Problem(f"submit.envs.{name}", "a Kubernetes Secret key holds only letters, digits, "
                                 "'-', '_' and '.': rename the variable",
                                 ("--set", "submit.envs.<NAME>=...")))
    return found + kubernetes_inputs.input_problems(options)


def envs_secret_name(job_name: str) -> str:
    """The Secret that holds the ``submit.envs`` of job ``job_name``."""
    return f"{job_name}-envs"


def build(job: JobSpec) -> SubmitRequest:
    options = job.options
    require([*request_problems(NAME, options, checkpoint_root=job.checkpoint_root, data_urls=job.data_urls),
             *elastic.problems(job)])
    target = f"kube context {options.kubernetes.context or '(current)'}, namespace {options.kubernetes.namespace}"
    notes = [*elastic.notes(NAME, job), *input_notes(kubernetes_inputs.input_mounts(job))]
    secrets = [_envs_secret(job)] if kubernetes_inputs.literal_envs(job) else []
    if options.kubernetes.api == "pytorchjob":
        return SubmitRequest(NAME, "create PyTorchJob", target, _pytorch_job(job), secrets, notes=notes,
                             secret_envs=job.envs)
    runtime = _cluster_training_runtime(job)
    return SubmitRequest(NAME, "create TrainJob", target, _train_job(job, runtime["metadata"]["name"]),
                         [*secrets, runtime], notes=notes, secret_envs=job.envs)


def grace_period_s(options: SubmitConfig) -> int:
    """The pods' ``terminationGracePeriodSeconds``: the notice window of the flavour's cloud."""
    from skylift.cloud.notice import notice_window_s

    vendor = kubernetes_flavours().get(options.kubernetes.cloud)
    return int(notice_window_s(vendor.name if vendor else None))


def _scheduling(options: SubmitConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": grace_period_s(options)}
    selector: dict[str, str] = {}
    if options.instance_type:
        selector["node.kubernetes.io/instance-type"] = options.instance_type
    if options.spot:
        flavour = kubernetes_flavours()[options.kubernetes.cloud].kubernetes
        assert flavour is not None  # kubernetes_flavours() holds only clouds that have one
        selector.update(flavour.spot_node_selector)
        if flavour.spot_tolerations:
            spec["tolerations"] = [dict(toleration) for toleration in flavour.spot_tolerations]
    if selector:
        spec["nodeSelector"] = selector
    return spec


def _env(job: JobSpec) -> list[dict[str, Any]]:
    """The container's environment: ``submit.envs`` by reference to a Secret, never by value."""
    env: list[dict[str, Any]] = [] if PLATFORM_VARIABLE in job.envs else [{"name": PLATFORM_VARIABLE, "value": NAME}]
    return env + kubernetes_inputs.container_env(job, envs_secret_name(job.name))


def _envs_secret(job: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": envs_secret_name(job.name), "namespace": job.options.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/managed-by": "skylift", "skylift.io/job": job.name}},
        "type": "Opaque",
        "stringData": kubernetes_inputs.literal_envs(job),
    }


def _resources(options: SubmitConfig) -> dict[str, Any] | None:
    if not options.gpus_per_node:
        return None
    return {"limits": {"nvidia.com/gpu": str(options.gpus_per_node)}}


def _runtime_name(job: JobSpec) -> str:
    options = job.options
    base = options.kubernetes.runtime_name
    name = f"{base}-spot-{options.kubernetes.cloud}" if options.spot else base
    return f"{name}-elastic" if job.nodes is not None else name


def _jobset_rules(job: JobSpec) -> list[dict[str, Any]]:
    fail = {"name": "fail-on-error", "action": "FailJobSet", "onJobFailureReasons": ["BackoffLimitExceeded"]}
    if job.nodes is not None:
        return [fail]  # a preempted pod is recreated by its Job: the JobSet never restarts for one
    return [{"name": "restart-on-preemption", "action": "RestartJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
            fail]


def _pod_failure_rules(job: JobSpec) -> list[dict[str, Any]]:
    # Saved-and-exited after SIGTERM (143) or evicted by a node disruption: a preemption.
    # A fixed job fails its Job for the JobSet to restart whole; an elastic one has the
    # Job recreate just that pod, while the others train on at the smaller size.
    action = "Ignore" if job.nodes is not None else "FailJob"
    return [
        {"action": action, "onExitCodes": {"containerName": "node", "operator": "In", "values": [EXIT_REQUEUE]}},
        {"action": action, "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]


def _cluster_training_runtime(job: JobSpec) -> dict[str, Any]:
    options = job.options
    pod_spec = {**_scheduling(options), "restartPolicy": "Never",
                "containers": [{"name": "node", "image": options.image}]}
    job_template = {
        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
        "spec": {
            "backoffLimit": 0,  # anything but a preemption fails the job
            "podFailurePolicy": {"rules": _pod_failure_rules(job)},
            "template": {"spec": pod_spec},
        },
    }
    return {
        "apiVersion": "/".join(TRAINER_API),
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": _runtime_name(job), "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {
                "failurePolicy": {
                    "maxRestarts": options.kubernetes.max_restarts,
                    "restartStrategy": "Recreate",
                    "rules": _jobset_rules(job),
                },
                "replicatedJobs": [{"name": "node", "replicas": 1, "template": job_template}],
            }},
        },
    }


def _train_job(job: JobSpec, runtime_name: str) -> dict[str, Any]:
    options = job.options
    trainer: dict[str, Any] = {
        "image": options.image,
        "command": job.command(job.grace_overrides(grace_period_s(options))),
        "env": _env(job),
        "numNodes": options.instance_count,
    }
    if options.gpus_per_node:
        trainer["numProcPerNode"] = options.gpus_per_node
        trainer["resourcesPerNode"] = _resources(options)
    spec: dict[str, Any] = {
        "runtimeRef": {"name": runtime_name, "kind": "ClusterTrainingRuntime", "apiGroup": TRAINER_API[0]},
        "trainer": trainer,
        "activeDeadlineSeconds": options.max_runtime_s,
    }
    pod_volumes, mounts = kubernetes_inputs.volumes(job)
    if pod_volumes:  # the inputs' volumes: a patch of the runtime's one replicated job, its pod and container
        pod = {"volumes": pod_volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
        replicated = {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
        spec["runtimePatches"] = [{"manager": "skylift", "trainingRuntimeSpec": {
            "template": {"spec": {"replicatedJobs": [replicated]}}}}]
    return {"apiVersion": "/".join(TRAINER_API), "kind": "TrainJob",
            "metadata": {"name": job.name, "namespace": options.kubernetes.namespace}, "spec": spec}


def _pytorch_job(job: JobSpec) -> dict[str, Any]:
    options = job.options
    command = job.command(job.grace_overrides(grace_period_s(options)))
    container: dict[str, Any] = {"name": "pytorch", "image": options.image, "command": command, "env": _env(job)}
    if _resources(options):
        container["resources"] = _resources(options)
    pod_volumes, container["volumeMounts"] = kubernetes_inputs.volumes(job)
    if not pod_volumes:
        del container["volumeMounts"]
    template = {"spec": {**_scheduling(options), "containers": [container],
                         **({"volumes": pod_volumes} if pod_volumes else {})}}

    def replicas(count: int) -> dict[str, Any]:
        # ExitCode: 1-127 permanent, 128-255 (our 143 after SIGTERM) retried.
        return {"replicas": count, "restartPolicy": "ExitCode", "template": template}

    if job.nodes is not None:
        specs = {"Worker": replicas(options.instance_count)}  # elastic: Workers only, the operator requires it
    else:
        specs = {"Master": replicas(1)}
        if options.instance_count > 1:
            specs["Worker"] = replicas(options.instance_count - 1)
    spec: dict[str, Any] = {
        "nprocPerNode": str(options.gpus_per_node) if options.gpus_per_node else "auto",
        "runPolicy": {"backoffLimit": options.kubernetes.max_restarts, "cleanPodPolicy": "None",
                      "activeDeadlineSeconds": options.max_runtime_s},
        "pytorchReplicaSpecs": specs,
    }
    if job.nodes is not None:
        spec["elasticPolicy"] = _elastic_policy(job.name, job.nodes)
    return {
        "apiVersion": "/".join(TRAINING_OPERATOR_API),
        "kind": "PyTorchJob",
        "metadata": {"name": job.name, "namespace": options.kubernetes.namespace},
        "spec": spec,
    }


def _elastic_policy(name: str, nodes: ElasticNodes) -> dict[str, Any]:
    """The operator turns it into the pods' PET_NNODES=MIN:MAX, PET_RDZV_BACKEND, PET_RDZV_ENDPOINT
    (``<job>-worker-0`` at the container's ``pytorchjob-port``), PET_RDZV_ID and PET_MAX_RESTARTS."""
    return {
        "minReplicas": nodes.min,
        "maxReplicas": nodes.max,
        "rdzvBackend": "c10d",
        "rdzvId": name,  # one rendezvous per submission: a resubmitted job does not meet the old one
        "maxRestarts": nodes.max_failures,
    }


def _client_module() -> Any:
    return import_sdk("kubernetes.client", NAME, "kubernetes")


def _api_client(context: str | None) -> Any:
    kubernetes = import_sdk("kubernetes", NAME, "kubernetes")
    from kubernetes.config.config_exception import ConfigException

    # The client reads KUBECONFIG once, at import; read it now, as kubectl does.
    config_file = os.environ.get("KUBECONFIG") or None
    try:
        return kubernetes.config.new_client_from_config(config_file=config_file, context=context)
    except ConfigException as error:
        raise SkyliftConfigError(
            f"no usable kube context: {error}",
            hint="Point kubectl at the cluster (KUBECONFIG or ~/.kube/config), "
            "check with: kubectl config current-context",
        ) from None


def _errors() -> Any:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    return vendor_errors(NAME, ApiException, HTTPError)


def send(request: SubmitRequest, options: SubmitConfig) -> JobRef:
    """The ``submit.envs`` Secret first (so no pod starts without it), then the runtime and
    the job; the Secret is deleted again if the job is refused, and owned by the job once
    it exists, so deleting the job (``skylift jobs stop``, ``kubectl delete``) deletes it."""
    client = _client_module()
    api_client = _api_client(options.kubernetes.context)
    custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
    body = request.body
    group, version = body["apiVersion"].split("/")
    plural = "trainjobs" if body["kind"] == "TrainJob" else "pytorchjobs"
    namespace = body["metadata"]["namespace"]
    secrets = [item for item in request.extra if item["kind"] == "Secret"]
    with _errors():
        for secret in secrets:
            core.create_namespaced_secret(namespace, secret)
        try:
            for runtime in request.extra:
                if runtime["kind"] != "Secret":
                    _apply_cluster_object(custom, runtime)
            created = custom.create_namespaced_custom_object(group, version, namespace, plural, body)
        except BaseException:  # refused, unreachable or interrupted: no Secret outlives a job never created
            _delete_secrets(core, namespace, secrets)
            raise
    for secret in secrets:
        _own_secret(core, namespace, secret["metadata"]["name"], created)
    return JobRef(NAME, f"{namespace}/{plural}", body["metadata"]["name"])


def _delete_secrets(core: Any, namespace: str, secrets: list[dict[str, Any]]) -> None:
    """Take back the Secrets of a job that was refused; one that cannot be is named, never left silently."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    for secret in secrets:
        name = secret["metadata"]["name"]
        try:
            core.delete_namespaced_secret(name, namespace)
        except (ApiException, HTTPError) as error:
            print(f"skylift submit: the job was refused and its Secret {name} could not be deleted "
                  f"({getattr(error, 'status', None) or type(error).__name__}); delete it with: "
                  f"kubectl delete secret {name} -n {namespace}", file=sys.stderr)


def _own_secret(core: Any, namespace: str, name: str, job: dict[str, Any]) -> None:
    """Make the job the Secret's owner, for the garbage collector to delete it with the job.
    The job runs either way: a failure here is said, with the command that cleans up."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    metadata = job.get("metadata") or {}
    owner = {"apiVersion": job.get("apiVersion"), "kind": job.get("kind"), "name": metadata.get("name"),
             "uid": metadata.get("uid")}
    problem = "the API server returned the job without a uid" if not all(owner.values()) else None
    if problem is None:
        try:
            core.patch_namespaced_secret(name, namespace, {"metadata": {"ownerReferences": [owner]}})
            return
        except (ApiException, HTTPError) as error:
            problem = redact(f"{getattr(error, 'status', '')} {getattr(error, 'reason', None) or error}".strip())
    print(f"skylift submit: the Secret {name} holding submit.envs could not be made owned by job "
          f"{metadata.get('name')} ({problem}); it stays after the job is deleted: "
          f"kubectl delete secret {name} -n {namespace}", file=sys.stderr)


def _apply_cluster_object(custom: Any, body: dict[str, Any]) -> None:
    from kubernetes.client.exceptions import ApiException

    group, version = body["apiVersion"].split("/")
    try:
        custom.create_cluster_custom_object(group, version, "clustertrainingruntimes", body)
    except ApiException as error:
        if error.status != 409:
            raise
        # Already there (an earlier submit): bring it up to date.
        custom.patch_cluster_custom_object(group, version, "clustertrainingruntimes", body["metadata"]["name"], body)


def _location(ref: JobRef) -> tuple[str, str, str, str]:
    namespace, _, plural = ref.location.partition("/")
    group, version = TRAINER_API if plural == "trainjobs" else TRAINING_OPERATOR_API
    return group, version, namespace, plural


def status(ref: JobRef, endpoint: str | None = None) -> JobStatus:
    client = _client_module()
    group, version, namespace, plural = _location(ref)
    with _errors():
        job = client.CustomObjectsApi(_api_client(endpoint)).get_namespaced_custom_object(
            group, version, namespace, plural, ref.job_id)
    conditions = {item["type"]: item for item in job.get("status", {}).get("conditions", [])
                  if item.get("status") == "True"}
    for kind, state in _CONDITION_STATES:
        if kind in conditions:
            return JobStatus(ref, state, f"{kind}: {conditions[kind].get('message', '')}".rstrip(": "))
    return JobStatus(ref, "pending", "Created")


def stop(ref: JobRef, endpoint: str | None = None) -> None:
    client = _client_module()
    group, version, namespace, plural = _location(ref)
    with _errors():
        client.CustomObjectsApi(_api_client(endpoint)).delete_namespaced_custom_object(
            group, version, namespace, plural, ref.job_id)


def logs(ref: JobRef, endpoint: str | None = None, max_lines: int = 200) -> list[str]:
    client = _client_module()
    _, _, namespace, plural = _location(ref)
    label = "jobset.sigs.k8s.io/jobset-name" if plural == "trainjobs" else "training.kubeflow.org/job-name"
    core = client.CoreV1Api(_api_client(endpoint))
    lines = []
    with _errors():
        for pod in core.list_namespaced_pod(namespace, label_selector=f"{label}={ref.job_id}").items:
            text = core.read_namespaced_pod_log(pod.metadata.name, namespace, tail_lines=max_lines)
            lines += [f"[{pod.metadata.name}] {line}" for line in text.splitlines()]
    return lines


def _detect_topology(environ: Mapping[str, str], root: Path) -> PlatformTopology | None:
    """Kubeflow Trainer (and the v1 PyTorchJob) set ``PET_NNODES``, ``PET_NODE_RANK``,
    ``PET_NPROC_PER_NODE`` and ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (v1: ``MASTER_*``).
    An elastic v1 PyTorchJob sets ``PET_NNODES=MIN:MAX`` and ``PET_RDZV_ENDPOINT`` instead
    of a master and a rank: the topology is then ``nnodes`` MAX, node 0, the endpoint as
    the master, and ``elastic_nodes`` (MIN, MAX)."""
    if "PET_NNODES" not in environ:
        return None
    address = environ.get("PET_MASTER_ADDR") or environ.get("MASTER_ADDR") or "127.0.0.1"
    port = optional_integer(environ, "PET_MASTER_PORT") or optional_integer(environ, "MASTER_PORT")
    elastic_range = _node_range(environ["PET_NNODES"]) if ":" in environ["PET_NNODES"] else None
    if elastic_range is not None and environ.get("PET_RDZV_ENDPOINT"):
        address, _, endpoint_port = environ["PET_RDZV_ENDPOINT"].rpartition(":")
        port = integer({"PET_RDZV_ENDPOINT": endpoint_port}, "PET_RDZV_ENDPOINT")
    nnodes = elastic_range[1] if elastic_range else integer(environ, "PET_NNODES")
    # "auto", "gpu" or "cpu" leave the count to the visible devices.
    return PlatformTopology("Kubeflow", "PET_* variables", nnodes,
                            optional_integer(environ, "PET_NODE_RANK") or 0, address, port,
                            optional_integer(environ, "PET_NPROC_PER_NODE"),
                            node_level_variables=("RANK", "WORLD_SIZE"), elastic_nodes=elastic_range,
                            node_rank_unknown=elastic_range is not None and "PET_NODE_RANK" not in environ)


def _node_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition(":")
    if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
        raise SkyliftConfigError(f"the platform set PET_NNODES={value!r}, which is neither a whole number nor MIN:MAX")
    return int(low), int(high)


def _elastic_note(nodes: ElasticNodes, count: int, options: SubmitConfig) -> str:
    return _kubernetes_note(options.kubernetes.api, nodes.min, nodes.max, count)


def _kubernetes_note(api: str | None, low: int, high: int, count: int) -> str:
    if api == "pytorchjob":
        return (f"elastic: yes, the PyTorchJob's elasticPolicy (minReplicas {low}, maxReplicas {high}, rdzvBackend "
                f"c10d) over {count} Worker pods: a lost pod leaves the others training at the smaller size, the "
                "operator recreates it (restartPolicy ExitCode) and it rejoins at the next checkpoint; the "
                "rendezvous lives on worker-0, whose loss ends the job")
    return (f"elastic: yes, inside the TrainJob, not in its API: Kubeflow Trainer v2 has no elasticPolicy "
            "(KEP-2903 is open) and refuses PET_NNODES in trainer.env, so `skylift run` hands torchrun "
            f"--nnodes {low}:{high} itself with the rendezvous at PET_MASTER_ADDR (node 0, whose loss ends the "
            f"job); the -elastic ClusterTrainingRuntime recreates a pod that exits 143 or is disrupted "
            "(podFailurePolicy Ignore) instead of restarting the JobSet, so the others keep training")


PLATFORM = Platform(
    name=NAME,
    title="Kubernetes (Kubeflow)",
    module=__name__,
    aliases=("kubernetes",),
    elastic_note=_elastic_note,
    detect_topology=_detect_topology,
    detect_order=10,  # PET_* variables are Kubeflow's alone
    endpoint=lambda options: options.kubernetes.context,
    request_format="yaml",
)

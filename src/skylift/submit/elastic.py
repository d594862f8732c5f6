"""Elastic jobs (``distributed.nodes: {min, max}``) on each platform: which keeps training
on fewer nodes after losing one, and which relaunches the whole job.

Only Kubernetes can replace one lost node while the others keep training: the
Training Operator v1 ``PyTorchJob`` has an ``elasticPolicy``, and a Kubeflow Trainer v2
``TrainJob`` can run torchrun's elastic rendezvous inside it when its runtime recreates a
lost pod instead of restarting the whole JobSet. SageMaker, SkyPilot, PAI-DLC and TI-ONE
start a fixed count of nodes and relaunch all of them after a preemption; the job then
resumes from its checkpoint at the full size, as a non-elastic one does, and ``skylift
jobs watch`` still resubmits a job the platform gave up on. ``skylift submit --dry-run``
prints which one applies (:func:`notes`).
"""

from __future__ import annotations

from skylift.submit.checks import Problem
from skylift.submit.spec import JobSpec

__all__ = ["notes", "problems"]

_WHOLE_JOB = {
    "sagemaker": "a SageMaker training job has a fixed ResourceConfig.InstanceCount, and a managed-spot "
                 "interruption stops every instance; SageMaker starts the {count} again and the job resumes from "
                 "CheckpointConfig (SageMaker HyperPod's elastic training is another service, not this API)",
    "skypilot": "a SkyPilot managed job relaunches the whole cluster after a preemption "
                "(skypilot-org/skypilot#3907): its {count} nodes start again and resume from the checkpoint root",
    "pai": "skylift asks PAI-DLC for a fixed PodCount ({count}) and nothing elastic; a lost node ends or restarts "
           "the whole job, which resumes from the checkpoint",
    "tione": "TI-ONE fails a DDP task when any instance exits non-zero, so a lost node ends the task of {count}; "
             "the resubmitted task resumes from the checkpoint",
}


def problems(job: JobSpec) -> list[Problem]:
    """An elastic job must start inside its own node range."""
    nodes = job.nodes
    count = job.options.instance_count
    if nodes is None or nodes.min <= count <= nodes.max:
        return []
    return [Problem("submit.instance_count",
                    f"{count} nodes is outside distributed.nodes [{nodes.min}, {nodes.max}]: torchrun's rendezvous "
                    "would wait for nodes that never come, or keep the extra ones idle",
                    ("--set", f"submit.instance_count={min(max(count, nodes.min), nodes.max)}"))]


def notes(platform: str, job: JobSpec, *, api: str | None = None) -> list[str]:
    """The dry-run lines that say whether ``platform`` keeps an elastic job running (none for a fixed job)."""
    nodes = job.nodes
    if nodes is None:
        return []
    count = job.options.instance_count
    if platform == "k8s":
        return [_kubernetes_note(api, nodes.min, nodes.max, count)]
    reason = _WHOLE_JOB[platform].format(count=count)
    return [f"elastic: no, {platform} relaunches whole jobs: {reason}. distributed.nodes "
            f"[{nodes.min}, {nodes.max}] asks the platform for nothing; `skylift jobs watch` resubmits as before"]


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

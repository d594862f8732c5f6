"""Elastic jobs (``distributed.nodes: {min, max}``) on each platform: which keeps training
on fewer nodes after losing one, and which relaunches the whole job.

Only Kubernetes can replace one lost node while the others keep training: the
Training Operator v1 ``PyTorchJob`` has an ``elasticPolicy``, and a Kubeflow Trainer v2
``TrainJob`` can run torchrun's elastic rendezvous inside it when its runtime recreates a
lost pod instead of restarting the whole JobSet. SageMaker, SkyPilot, PAI-DLC and TI-ONE
start a fixed count of nodes and relaunch all of them after a preemption; the job then
resumes from its checkpoint at the full size, as a non-elastic one does, and ``skylift
jobs watch`` still resubmits a job the platform gave up on. ``skylift submit --dry-run``
prints which one applies (:func:`notes`, from each platform's ``elastic_note``).
"""

from __future__ import annotations

from collections.abc import Callable

from skylift.config.distributed import ElasticNodes
from skylift.config.submit import SubmitConfig
from skylift.submit.base import platform_info
from skylift.submit.checks import Problem
from skylift.submit.spec import JobSpec

__all__ = ["notes", "problems", "whole_job"]


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


def notes(platform: str, job: JobSpec) -> list[str]:
    """The dry-run lines that say whether ``platform`` keeps an elastic job running (none for a fixed job)."""
    nodes = job.nodes
    if nodes is None:
        return []
    return [platform_info(platform).elastic_note(nodes, job.options.instance_count, job.options)]


def whole_job(platform: str, reason: str) -> Callable[[ElasticNodes, int, SubmitConfig], str]:
    """The elastic note of a platform that relaunches whole jobs; ``reason`` may name ``{count}``."""

    def note(nodes: ElasticNodes, count: int, options: SubmitConfig) -> str:
        return (f"elastic: no, {platform} relaunches whole jobs: {reason.format(count=count)}. distributed.nodes "
                f"[{nodes.min}, {nodes.max}] asks the platform for nothing; `skylift jobs watch` resubmits as before")

    return note

"""Launch: the side of a job that starts workers and never runs inside one.

:mod:`~skylift.launch.launcher` turns a topology into torchrun's arguments (or starts
preloaded workers, :mod:`~skylift.launch.preloaded_workers`);
:mod:`~skylift.launch.elastic` and :mod:`~skylift.launch.elastic_agent` run an elastic
job's rendezvous and agent; :mod:`~skylift.launch.preflight` checks a job before any
worker starts. The worker's side of the elastic contract (the variables and files the
agent and its workers share) is :mod:`skylift.train.elastic_environment`, read in every
worker.
"""

from __future__ import annotations

__all__: list[str] = []

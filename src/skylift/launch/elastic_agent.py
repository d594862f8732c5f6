"""skylift's torchrun agent: ``LocalElasticAgent`` with a node that leaves on its own notice.

The monitoring loop is torchrun's ``SimpleElasticAgent._invoke_run`` (torch 2.14) with the
ended-early branch split three ways (see :mod:`skylift.launch.elastic`; a node
that could not leave cleanly is dropped after its missed keep-alives). Everything else,
rendezvous, worker start and stop, exit barrier, is torchrun's own.

torch has no public hook for any of the three (the monitoring loop, the stop timeout of a
restart, leaving a rendezvous without closing it), so this module overrides private
methods and reaches into the rendezvous handler. :data:`TORCH_PINS` names every such
piece of torch with a digest of its source: ``tests/elastic/test_torch_pins.py`` fails
on a torch whose code differs, so an upgrade is checked in the suite, not on a cluster.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from skylift.errors import EXIT_REQUEUE
from skylift.train.elastic_environment import EXIT_CODES_FINAL, RESTART_REASON_VARIABLE

__all__ = ["TORCH_PINS", "SkyliftAgent", "committed_stop"]

log = logging.getLogger("skylift")

_AGENT = "torch.distributed.elastic.agent.server"
_RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
TORCH_PINS: dict[str, tuple[str, str]] = {
    f"{_AGENT}.api:SimpleElasticAgent._invoke_run": (
        "2242a87335ee7b58", "SkyliftAgent._invoke_run is a copy of it: carry its change over"),
    f"{_AGENT}.api:SimpleElasticAgent._restart_workers": (
        "8f18f2dc8b4d2a04", "SkyliftAgent._restart relies on it stopping (our _stop_workers) then re-forming"),
    f"{_AGENT}.api:SimpleElasticAgent.__init__": (
        "8760d4a767d2f1b5", "_remaining_restarts and _worker_group, which SkyliftAgent reads and counts down"),
    f"{_AGENT}.local_elastic_agent:LocalElasticAgent.__init__": (
        "a372174365c44139", "_shutdown_timeout (torchrun's --shutdown-timeout), which SkyliftAgent stops with"),
    f"{_AGENT}.local_elastic_agent:LocalElasticAgent._stop_workers": (
        "f17c6bac24436041", ("SkyliftAgent._stop_workers replaces its fixed 30 s: drop the override if torch "
                             "now passes _shutdown_timeout itself")),
    f"{_AGENT}.local_elastic_agent:LocalElasticAgent._shutdown": (
        "201669f13436c893", "SkyliftAgent._stop_workers calls it with a timeout"),
    f"{_RENDEZVOUS}:DynamicRendezvousHandler.shutdown": (
        "6440ab67c243e54d", ("SkyliftAgent._leave does its first half (stop the keep-alive) without closing the "
                             "rendezvous: use a public leave if torch added one")),
    f"{_RENDEZVOUS}:DynamicRendezvousHandler._stop_heartbeats": ("89fd118b95e4a439", "SkyliftAgent._leave calls it"),
    f"{_RENDEZVOUS}:_RendezvousExitOp": ("1207ff14faf464e0", "SkyliftAgent._leave runs it to leave the round"),
    f"{_RENDEZVOUS}:_DistributedRendezvousOpExecutor.run": (
        "43f0a3fb2b00c46b", "SkyliftAgent._leave runs the exit op through it (op, deadline)"),
    "torch.distributed.launcher.api:launch_agent": (
        "eda9a3b04f9c1aaa", "skylift.launch.elastic._build_agent builds what it builds, with SkyliftAgent"),
    "torch.distributed.launcher.api:_get_addr_and_port": (
        "254baca413485cdd", "skylift.launch.elastic._build_agent calls it as launch_agent does"),
}
"""torch's private code this module and :mod:`skylift.launch.elastic` copied or reach
into: ``module:qualified name`` -> (the first 16 hex digits of the sha256 of its source's
AST, comments and layout left out, in torch 2.14.1; what to re-check when it changes)."""


def committed_stop(result: RunResult) -> bool:
    """The workers stopped after an agreed stop with its checkpoint committed: a worker
    exited 143 and the others did too, or were ended by a signal (an agent closing the
    group ends the rest once one has exited)."""
    codes = [failure.exitcode for failure in result.failures.values()]
    return EXIT_REQUEUE in codes and all(code == EXIT_REQUEUE or code < 0 for code in codes)


class SkyliftAgent(LocalElasticAgent):
    """Args as ``LocalElasticAgent``'s, plus ``notice_marker``: the file this node's local
    rank 0 writes when the node's own cloud announced its reclaim."""

    def __init__(self, *args: Any, notice_marker: Path, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notice_marker = notice_marker
        self.left = False
        """True once this node left the job for its own notice."""
        self.failures = 0

    def _stop_workers(self, worker_group: Any) -> None:
        # torch's LocalElasticAgent stops with a fixed 30 s; a restart for a joining node
        # must give the workers the notice window the launcher was given to checkpoint in.
        self._shutdown(timeout=self._shutdown_timeout)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self.get_worker_group()
        self._initialize_workers(group)
        while True:
            time.sleep(group.spec.monitor_interval)
            result = self._monitor_workers(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                return result
            if result.state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                if self._ended_early(result):
                    return result
            elif result.state == WorkerState.HEALTHY and group.spec.rdzv_handler.num_nodes_waiting() > 0:
                # membership changes do not count as retries (as torchrun)
                self._restart("node_joined", "a node is waiting to join")
            elif result.state != WorkerState.HEALTHY:
                raise RuntimeError(f"[{role}] worker group in {result.state.name} state")

    def _ended_early(self, result: RunResult) -> bool:
        """Restart the group where that helps; True when this agent is done."""
        if committed_stop(result) and self.notice_marker.exists():
            self.left = True
            self._leave()
            return True
        if committed_stop(result):
            self._restart("notice", "the workers stopped at a committed checkpoint for another node's notice")
            return False
        codes = {failure.exitcode for failure in result.failures.values()}
        group = self.get_worker_group()
        if codes & EXIT_CODES_FINAL or self._remaining_restarts <= 0:
            self._stop_workers(group)
            group.state = WorkerState.FAILED
            return True
        self._remaining_restarts -= 1
        self.failures += 1
        self._restart("node_lost", f"workers failed (exit codes {sorted(codes)}); "
                      f"{self._remaining_restarts} of {group.spec.max_restarts} restarts left")
        return False

    def _restart(self, reason: str, why: str) -> None:
        log.warning("skylift elastic: %s; restarting the workers at the new size", why)
        os.environ[RESTART_REASON_VARIABLE] = reason  # the restarted workers inherit it
        self._restart_workers(self.get_worker_group())

    def _leave(self) -> None:
        """Stop the workers and take this node out of the rendezvous round without closing it
        (``shutdown()`` would close it for the survivors too). If the exit fails, the node's
        keep-alive stops and the others drop it after that many keep-alive intervals."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, _RendezvousExitOp

        group = self.get_worker_group()
        self._stop_workers(group)
        group.state = WorkerState.FAILED
        handler = group.spec.rdzv_handler
        try:
            if not isinstance(handler, DynamicRendezvousHandler):  # c10d's handler is one
                raise TypeError(f"{type(handler).__name__} is not torch's DynamicRendezvousHandler")
            handler._stop_heartbeats()
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 30)
        except Exception as error:  # noqa: BLE001 - the keep-alive expiry still removes this node
            log.warning("skylift elastic: could not leave the rendezvous cleanly (%s)", error)

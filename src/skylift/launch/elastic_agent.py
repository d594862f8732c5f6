"""skylift's torchrun agent: ``LocalElasticAgent`` with a node that leaves on its own notice.

The monitoring loop is torchrun's ``SimpleElasticAgent._invoke_run`` (torch 2.14) with the
ended-early branch split three ways (see :mod:`skylift.launch.elastic`; a node
that could not leave cleanly is dropped after its missed keep-alives). Everything else,
rendezvous, worker start and stop, exit barrier, is torchrun's own.
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

__all__ = ["SkyliftAgent", "committed_stop"]

log = logging.getLogger("skylift")


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
        group = self._worker_group
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
        if codes & EXIT_CODES_FINAL or self._remaining_restarts <= 0:
            self._stop_workers(self._worker_group)
            self._worker_group.state = WorkerState.FAILED
            return True
        self._remaining_restarts -= 1
        self.failures += 1
        self._restart("node_lost", f"workers failed (exit codes {sorted(codes)}); "
                      f"{self._remaining_restarts} of {self._worker_group.spec.max_restarts} restarts left")
        return False

    def _restart(self, reason: str, why: str) -> None:
        log.warning("skylift elastic: %s; restarting the workers at the new size", why)
        os.environ[RESTART_REASON_VARIABLE] = reason  # the restarted workers inherit it
        self._restart_workers(self._worker_group)

    def _leave(self) -> None:
        """Stop the workers and take this node out of the rendezvous round without closing it
        (``shutdown()`` would close it for the survivors too). If the exit fails, the node's
        keep-alive stops and the others drop it after that many keep-alive intervals."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        self._stop_workers(self._worker_group)
        self._worker_group.state = WorkerState.FAILED
        handler = self._worker_group.spec.rdzv_handler
        try:
            handler._stop_heartbeats()
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 30)
        except Exception as error:  # the keep-alive expiry still removes this node
            log.warning("skylift elastic: could not leave the rendezvous cleanly (%s)", error)

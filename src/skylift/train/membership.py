"""The ``membership`` record of an elastic job: written once per attempt whose world size
differs from the checkpoint it resumed, at that attempt's first step. An attempt that
resumed at the job's last step trains none and writes none: it has no first step to
measure the seconds lost to, and its ``run_start`` still shows the new world size.

What each field comes from:

* old world size: the resumed checkpoint's manifest; old and new node counts: the world
  sizes over this node's processes (torchrun starts the same ``--nproc-per-node`` on
  every node);
* reason: ``node_joined`` when the size rose; when it fell, ``node_lost`` if the agent
  restarted the workers after a failure (it says so in ``SKYLIFT_ELASTIC_RESTART``),
  else ``notice``;
* seconds lost: from the old size's last finished step (this node's record of it, else
  the checkpoint's commit time) to the end of this size's first step; steps lost: the
  steps past the checkpoint the old size had finished (after a failure only).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from skylift.loop.events import Callback, TrainState
from skylift.train.elastic_environment import ELASTIC_DIR_VARIABLE, RESTART_REASON_VARIABLE, last_step, write_last_step

__all__ = ["MembershipWatch"]

log = logging.getLogger("skylift")


class MembershipWatch(Callback):
    """Subscribe to the loop's events in an elastic job's worker.

    Args:
        context: the distributed context (rank 0 writes the record, local rank 0 this
            node's last step).
        write_record: writes one metrics record (rank 0's metrics logger).
    """

    def __init__(self, context: Any, write_record: Any) -> None:
        self.context = context
        self.write_record = write_record
        self.pending: dict[str, Any] | None = None
        self._previous = last_step()  # before this attempt's first step overwrites it

    @staticmethod
    def wanted() -> bool:
        return bool(os.environ.get(ELASTIC_DIR_VARIABLE))

    def resumed(self, step: int, manifest: Any) -> None:
        """The checkpoint at ``step`` with ``manifest`` was resumed: prepare the record if the size changed."""
        new_size, old_size = self.context.world_size, manifest.world_size
        if not self.context.is_main or new_size == old_size:
            return
        per_node = max(self.context.local_world_size, 1)
        restarted_for = os.environ.get(RESTART_REASON_VARIABLE)
        reason = "node_joined" if new_size > old_size else "node_lost" if restarted_for == "node_lost" else "notice"
        last_step_done, last_step_time = step, manifest.created_at
        if self._previous is not None and self._previous[0] >= step:
            last_step_done, last_step_time = self._previous
        self.pending = {
            "kind": "membership", "step": step, "old_world_size": old_size, "new_world_size": new_size,
            "old_nodes": max(old_size // per_node, 1), "new_nodes": self.context.num_nodes, "reason": reason,
            "steps_lost": last_step_done - step if reason == "node_lost" else 0, "_since": last_step_time,
        }

    def on_step_end(self, state: TrainState) -> None:
        if self.context.local_rank == 0:
            write_last_step(state.step)
        if self.pending is None:
            return
        record, self.pending = self.pending, None
        now = time.time()
        record["seconds_lost"] = round(max(now - record.pop("_since"), 0.0), 3)
        self.write_record({"time": now, **record})
        log.warning("membership: %d -> %d ranks (%s) at step %d, %.1f s lost", record["old_world_size"],
                    record["new_world_size"], record["reason"], record["step"], record["seconds_lost"])

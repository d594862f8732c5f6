"""``checkpoint.memory``: every checkpoint in host memory first, replicated to a peer node.

A save commits three times, each by the same rule (files, then a manifest): in this
node's memory (a tmpfs folder, by :class:`~skylift.checkpoint.tiers.LocalTier`'s code),
then *safe* once every node has sent its share to the next node's memory (ring order,
replica.py), then *durable* once uploaded to ``checkpoint.root`` (the manager's second
commit, as with a node disk). The object store stays the truth across whole-job
restarts; the memory copies serve a restart whose nodes kept their memory.

What survives which failure:

* a worker crash (the agent restarts the node's workers): the node's own memory copy;
* a node lost (SIGKILL, a reclaimed VM): the survivors hold its share in the replica
  its ring neighbour received, so they resume without reading the object store;
* every node holding a step gone at once (a whole job, a region): the newest durable
  step in the object store; the resume says which safe step it had to pass over.

Memory holds at most ``KEEP_IN_MEMORY`` committed steps and the one being written, each
with this node's share and its ring predecessor's.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from skylift.checkpoint.manifest import Manifest, step_folder
from skylift.checkpoint.replica import ReplicaPeer, ReplicaReceiver, node_address, send_step
from skylift.checkpoint.tiers import LocalTier
from skylift.config.checkpoint import MemoryTierConfig
from skylift.errors import SkyliftConfigError
from skylift.machine.memory import MEMORY_TIER_COPIES
from skylift.storage import Store

__all__ = ["KEEP_IN_MEMORY", "SAFE_MARKER", "MemoryTier", "memory_budget_problem", "refuse_misuse",
           "state_bytes"]

log = logging.getLogger("skylift")

KEEP_IN_MEMORY = 2
"""Committed steps kept in memory: the newest, and one before it in case the newest is
torn on some node (its replica cut short, say)."""

COPIES_AT_PEAK = MEMORY_TIER_COPIES
"""While a save is written, the steps kept plus the new one."""
assert COPIES_AT_PEAK == KEEP_IN_MEMORY + 1

SAFE_MARKER = "SAFE"
"""A small object at the root naming the newest safe step, so that a resume that finds it
nowhere can say which step it had to pass over."""


class MemoryTier(LocalTier):
    """This node's memory copies of one run's checkpoints, and the link to its ring peer.

    Args:
        config: ``checkpoint.memory``.
        remote: the object-store root the copies belong to.
        node_leader: this process tends the node's folder and its replication (local rank 0).
    """

    keep = KEEP_IN_MEMORY
    setting = "checkpoint.memory.root"
    copy_name = "memory copy"

    def __init__(self, config: MemoryTierConfig, remote: Store, *, node_leader: bool) -> None:
        super().__init__(config.root, remote, node_leader=node_leader)
        self.config = config
        self.receiver: ReplicaReceiver | None = None
        self.peer: ReplicaPeer | None = None
        self.node_rank = 0
        self.timeout_s = 600.0
        self.bytes_sent: dict[int, int] = {}
        self.ended_durable = False
        """The run ended (not stopped) with its last checkpoint in the object store: :meth:`close`
        then hands the memory back, since nothing will resume from it."""
        self.replicates = False
        """Whether saves go on to a peer node (more than one node, replication on): set
        by :meth:`connect` on every rank, since every rank joins the *safe* agreement."""

    def listen(self, master_address: str, *, timeout_s: float) -> ReplicaPeer | None:
        """Start this node's receiver (node leaders, with replication on); return where it
        listens, for the other nodes."""
        self.timeout_s = timeout_s
        if not (self.node_leader and self.config.replicate):
            return None
        address = node_address(master_address)
        self.receiver = ReplicaReceiver(self.store, address, self.config.port, timeout_s=timeout_s)
        return self.receiver.peer

    def connect(self, node_rank: int, receivers: dict[int, ReplicaPeer]) -> None:
        """Take the next node in ring order as this node's peer (``receivers``: every node
        leader's, by node rank)."""
        self.node_rank, self.replicates = node_rank, self.config.replicate and len(receivers) > 1
        if self.node_leader and self.replicates:
            order = sorted(receivers)
            self.peer = receivers[order[(order.index(node_rank) + 1) % len(order)]]

    def replicate(self, step: int, manifest: bytes, check: Callable[[], None] = lambda: None, rank: int = 0) -> int:
        """Send this node's files of ``step`` (those the manifest lists) to the peer, then
        the manifest; return the bytes sent (files the peer held already are not sent).

        Raises:
            ReplicaError: the peer did not store them.
        """
        assert self.peer is not None, "connect() gives a node leader its peer first"
        listed = Manifest.decode(manifest, self.store.describe(step_folder(step))).files
        folder = step_folder(step)
        names = sorted(name for name in listed if self.store.exists(f"{folder}/{name}"))
        sent = send_step(self.store, step, manifest, names, self.peer, timeout_s=self.timeout_s, check=check,
                         rank=rank)
        self.bytes_sent[step] = sent
        return sent

    def held_bytes(self) -> int:
        """Bytes this run's copies take in memory on this node (own and replica)."""
        return sum(path.stat().st_size for path in self.store.root.rglob("*") if path.is_file())

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.ended_durable and self.node_leader:
            # A finished job's copies would hold the node's memory until a reboot.
            shutil.rmtree(self.store.root, ignore_errors=True)
            log.info("checkpoint memory tier: the run ended durable; %s released", self.store.root)


def state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of a full copy of the model's parameters and buffers and the optimizer's state.

    A fresh optimizer holds no state yet: Adam's two moments (and SGD's momentum) are
    counted from the trainable parameters, as the first step will make them."""
    import torch

    def numel_bytes(tensor: Any) -> int:
        return int(tensor.numel()) * tensor.element_size()

    total = sum(numel_bytes(tensor) for tensor in (*model.parameters(), *model.buffers()))
    held = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    if held:
        return total + sum(numel_bytes(tensor) for tensor in held)
    trainable = sum(int(p.numel()) * 4 for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
    name = type(optimizer).__name__.lower()
    moments = 2 if "adam" in name else 1 if name == "sgd" and any(g.get("momentum") for g in optimizer.param_groups) \
        else 0
    return total + moments * trainable


def memory_budget_problem(tier: MemoryTier, node_share_bytes: int, peer_share_bytes: int) -> str | None:
    """Why this node's memory cannot hold the tier's copies, or None: ``COPIES_AT_PEAK``
    steps of this node's share and its peer's, against what the tmpfs can still take."""
    needed = COPIES_AT_PEAK * (node_share_bytes + peer_share_bytes)
    root = tier.store.root
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free + tier.held_bytes()
    if needed <= free:
        return None
    gib = 2**30
    return (f"checkpoint.memory: this node needs {needed / gib:.1f} GiB of memory for its checkpoints "
            f"({COPIES_AT_PEAK} steps of its {node_share_bytes / gib:.2f} GiB share and its peer's "
            f"{peer_share_bytes / gib:.2f} GiB) "
            f"but {root} can take {free / gib:.1f} GiB; enlarge the tmpfs (mount -o remount,size=NG "
            f"{_mount_point(root)}) or set checkpoint.memory.enabled: false")


def _mount_point(path: Any) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def refuse_misuse(remote: Store, local_root: str | None) -> None:
    """The memory tier sits in front of an object store, and alone (one local tier)."""
    from skylift.storage.local import LocalStore

    if isinstance(remote, LocalStore):
        raise SkyliftConfigError(
            f"checkpoint.memory.enabled is set but checkpoint.root ({remote.url}) is a local folder; the memory tier "
            "sits in front of an object store: set checkpoint.root to an s3://, oss:// or cos:// URL, or set "
            "checkpoint.memory.enabled: false")
    if local_root is not None:
        raise SkyliftConfigError(
            "checkpoint.memory.enabled and checkpoint.local_root are both set; choose one local tier: the memory "
            "tier (seconds, replicated to a peer node) or the node disk (outlives a stopped VM)")



def join_ring(tier: MemoryTier, node_rank: int, gather_all: Any, *, timeout_s: float) -> None:
    """Every rank (collective): node leaders start their receivers, everyone learns each
    node's, and each node leader takes the next node as its peer."""
    listening = tier.listen(os.environ.get("MASTER_ADDR", "127.0.0.1"), timeout_s=timeout_s)
    receivers = {rank_of_node: peer for rank_of_node, peer in gather_all((node_rank, listening)) if peer is not None}
    if not tier.config.replicate:
        receivers = {}
    tier.connect(node_rank, receivers)
    if tier.peer is not None:
        log.info("checkpoint memory tier: node %d replicates to the node at %s", node_rank, tier.peer.describe())


def check_budget(tier: MemoryTier, objects: Any, sharded: bool, context: Any, gather_all: Any) -> None:
    """Refuse, on every rank alike, a run whose checkpoints this node's memory cannot hold.

    A node's share is the whole state when replicated (DDP: its leader writes it) or its
    ranks' shards (FSDP). What its peer sends: that much again under FSDP; under DDP only
    the few per-rank files, since every node holds the replicated state itself."""
    problem = None
    if tier.node_leader:
        whole = state_bytes(objects.model, objects.optimizer)
        share = whole * context.local_world_size // max(context.world_size, 1) if sharded else whole
        problem = memory_budget_problem(tier, share, share if sharded and tier.replicates else 0)
    problems = [item for item in gather_all(problem) if item]
    if problems:
        raise SkyliftConfigError(problems[0])


def passed_over_safe_step(remote: Store, resumed_step: int | None) -> str | None:
    """Warn of the safe step this resume could not find in any memory; return the line, or None."""
    try:
        named = remote.read_bytes(SAFE_MARKER).decode().strip()
    except Exception:  # noqa: BLE001 - no marker (never safe) or unreadable: nothing to say
        return None
    step = int(named.removeprefix("step-")) if named.removeprefix("step-").isdigit() else None
    if step is None or (resumed_step is not None and step <= resumed_step):
        return None
    line = (f"step {step} was safe in memory, but no node of this job holds it now (every node that held it is "
            f"gone); resumed from step {resumed_step or 0}, the newest durable checkpoint in {remote.url}")
    log.warning("%s", line)
    return line

"""The memory tier against node disk and S3: seconds to *safe*, to committed, stall, restore.

Two processes over gloo on loopback play two nodes (one rank each, so each is its node's
leader), training a model of ``Linear(4096, 4096)`` layers sharded by FSDP2 with AdamW,
so that each node's share of the state (weights and both Adam moments) is the size asked
for and differs from its peer's, as under FSDP. Each save goes through skylift's real
:class:`~skylift.checkpoint.manager.CheckpointManager` and ``capture_sharded`` at a step
boundary, blocking (the path a spot notice takes), to:

* ``memory``: ``checkpoint.memory`` (tmpfs under /dev/shm, replicated to the other
  process over TCP) in front of S3 on moto (on rclone above ``--no-s3-above-gb``): ``commit_s`` to the node's memory, ``safe_s``
  to both nodes' memory, ``durable_s`` to the S3 manifest;
* ``disk``: ``checkpoint.local_root`` on the system's temp folder, in front of S3 on
  moto: ``commit_s`` to the node disk;
* ``s3_moto`` and ``s3_rclone``: straight to S3 (moto, and ``rclone serve s3`` over a
  folder on disk: the two local S3 servers of benchmarks/checkpoint.py): ``commit_s``.

All counted from the step boundary (``stall_s``, the copy off the live tensors, included).
Then, per size: ``stall_ratio``, an async save's stall over 50 training steps (one save
per 50 steps); and the restore of the lost node's share by the survivor: read and
verified from the replica in its memory, against from S3 (moto).

    python -m benchmarks.memory_tier [--sizes-gb 0.1 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint_targets import s3_rclone_target, s3_target
from benchmarks.common import environment

RESULTS = Path(__file__).parent / "results" / "memory_tier.json"
WIDTH = 4096
LAYER_STATE_BYTES = 3 * 4 * WIDTH * (WIDTH + 1)  # fp32 weights, bias and two Adam moments
STEPS_BETWEEN_SAVES = 50


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker(rank: int, port: int, size_gb: float, roots: dict[str, str], out: str) -> None:
    """One 'node': build the sharded model, save to each target, time it; rank 0 writes ``out``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from skylift.checkpoint.manager import CheckpointManager
    from skylift.checkpoint.manifest import Manifest
    from skylift.checkpoint.memory_tier import MemoryTier, join_ring
    from skylift.checkpoint.sharded import capture_sharded
    from skylift.checkpoint.tiers import LocalTier, read_with_fallback
    from skylift.config.checkpoint import MemoryTierConfig
    from skylift.storage import open_store

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    layers = max(1, round(2 * size_gb * 2**30 / LAYER_STATE_BYTES))  # two nodes' shares
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8, WIDTH)

    def train_step() -> float:
        started = time.perf_counter()
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    step_times = [train_step() for _ in range(4)][1:]

    def gather(value: Any) -> list[Any]:
        values: list[Any] = [None] * 2
        dist.all_gather_object(values, value, group=group)
        return values

    def save(manager: CheckpointManager, step: int, blocking: bool = True) -> Any:
        result = manager.save(lambda: capture_sharded(
            step=step, rank=rank, model=model, optimizer=optimizer, scheduler=None, scaler=None,
            counters={"step": step, "epoch": 0, "samples_seen": 0}, group=group, defer=not blocking,
            reference_host_tensors=blocking, replicated=True), step, blocking=blocking)  # fmt: skip
        manager.wait()
        return result

    figures: dict[str, Any] = {"layers": layers, "step_s": statistics.median(step_times), "tiers_upload_to": roots["behind"]}
    moto = open_store(roots["memory_root"], endpoint_url=roots["moto_endpoint"])
    memory = MemoryTier(MemoryTierConfig(enabled=True, root=f"{roots['memory']}/node{rank}"), moto, node_leader=True)
    join_ring(memory, rank, gather, timeout_s=600)
    manager = CheckpointManager(moto, rank=rank, world_size=2, keep=2, async_save=True, group=group, tier=memory)
    result = save(manager, 1)
    share = sum(path.stat().st_size for path in memory.store.path("step-1").iterdir()) // 2  # own + replica
    figures["memory"] = {"share_bytes": share, "stall_s": result.stall_s, "commit_s": result.local_commit_s,
                         "safe_s": result.safe_s, "durable_s": result.write_s, "safe": result.safe}  # fmt: skip

    # The survivor (rank 0) reads the lost node's share: from its replica, and from S3.
    manifest = Manifest.decode(memory.store.read_bytes("step-1/manifest.json"), "bench")
    lost = sorted(name for name in manifest.files if "rank1" in name)
    if rank == 0:
        started = time.perf_counter()
        _, sources = read_with_fallback(manifest, lost, memory.store, moto)
        from_peer_s = time.perf_counter() - started
        started = time.perf_counter()
        read_with_fallback(manifest, lost, None, moto)
        figures["restore"] = {"bytes": sum(manifest.files[name]["size"] for name in lost), "from_peer_s": from_peer_s,
                              "from_s3_s": time.perf_counter() - started,
                              "peer_copy": set(sources.values()) == {"local"}}  # fmt: skip
    gather(None)  # the survivor's reads done before anything is removed

    # An async save's stall (the copy the next optimizer step waits for) per 50 steps.
    started = time.perf_counter()
    async_result = manager.save(lambda: capture_sharded(
        step=2, rank=rank, model=model, optimizer=optimizer, scheduler=None, scaler=None,
        counters={"step": 2, "epoch": 0, "samples_seen": 0}, group=group, defer=True,
        replicated=True), 2)  # fmt: skip
    manager.wait_for_copies()
    stall_s = time.perf_counter() - started
    manager.wait()
    figures["async_stall_s"] = stall_s
    figures["stall_ratio"] = stall_s / (STEPS_BETWEEN_SAVES * figures["step_s"])
    figures["async_safe"] = async_result.safe
    manager.close()
    memory.close()
    shutil.rmtree(memory.store.root, ignore_errors=True)
    moto.delete_prefix("")

    disk = LocalTier(f"{roots['disk']}/node{rank}", moto, node_leader=True)
    manager = CheckpointManager(moto, rank=rank, world_size=2, keep=2, async_save=False, group=group, tier=disk)
    result = save(manager, 3)
    figures["disk"] = {"stall_s": result.stall_s, "commit_s": result.local_commit_s, "durable_s": result.write_s}
    shutil.rmtree(disk.store.root, ignore_errors=True)
    moto.delete_prefix("")

    for name in ("s3_moto", "s3_rclone"):
        if not roots.get(name):
            continue
        store = moto if name == "s3_moto" else open_store(roots[name], endpoint_url=roots["rclone_endpoint"])
        manager = CheckpointManager(store, rank=rank, world_size=2, keep=2, async_save=False, group=group)
        result = save(manager, 4)
        figures[name] = {"stall_s": result.stall_s, "commit_s": result.write_s, "committed": result.committed}
        store.delete_prefix("")
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    dist.barrier(group=group)
    dist.destroy_process_group()


def measure(size_gb: float, with_s3: bool) -> dict[str, Any]:
    """One size: the memory and disk tiers (in front of moto) always; straight to S3
    (moto and rclone) with ``with_s3``."""
    import torch.multiprocessing as mp

    # moto keeps every object in this machine's memory: above --no-s3-above-gb the tiers
    # upload to rclone (objects on disk) instead, and the direct S3 saves are left out.
    moto = s3_target() if with_s3 else None
    rclone = s3_rclone_target()
    behind = moto or rclone
    scratch = tempfile.mkdtemp(prefix="skylift-bench-disk-")
    memory = f"/dev/shm/skylift-bench-{uuid.uuid4().hex[:8]}"
    out = os.path.join(scratch, "figures.json")
    roots = {"memory": memory, "disk": scratch, "moto_endpoint": behind.endpoint_url or "",
             "memory_root": behind.url, "behind": "moto" if moto else "rclone",
             "s3_moto": moto.url if moto is not None else "", "s3_rclone": rclone.url if with_s3 else "",
             "rclone_endpoint": rclone.endpoint_url or ""}  # fmt: skip
    try:
        mp.spawn(worker, args=(_free_port(), size_gb, roots, out), nprocs=2)
        return dict(json.loads(Path(out).read_text()))
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
        if moto is not None:
            moto.close()
        rclone.close()


def _row(size: float, figures: dict[str, Any]) -> str:
    def seconds(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"

    direct = figures.get("s3_moto", {}).get("commit_s"), figures.get("s3_rclone", {}).get("commit_s")
    return (f"| {figures['memory']['share_bytes'] / 2**30:.2f} | {seconds(figures['memory']['safe_s'])} | "
            f"{seconds(figures['memory']['commit_s'])} | {seconds(figures['disk']['commit_s'])} | "
            f"{seconds(direct[0])} | {seconds(direct[1])} | {seconds(figures['memory']['durable_s'])} | "
            f"{figures['stall_ratio'] * 100:.2f}% | {seconds(figures['restore']['from_peer_s'])} | "
            f"{seconds(figures['restore']['from_s3_s'])} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.1, 0.5, 1.0, 1.5])
    parser.add_argument("--no-s3-above-gb", type=float, default=1.0,
                        help="larger sizes skip the direct S3 saves (moto keeps objects in memory)")
    parser.add_argument("--quick", action="store_true", help="0.02 GB only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [0.02] if args.quick else args.sizes_gb
    results: dict[str, Any] = {}
    report = {"config": {**environment(1, ("torch", "moto")), "sizes_gb": sizes,
                         "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()},
              "results": results}  # fmt: skip
    for size in sizes:
        print(f"measuring {size} GB per node ...", flush=True)
        try:
            results[str(size)] = measure(size, with_s3=size <= args.no_s3_above_gb)
        except Exception as failure:  # noqa: BLE001 - a size this machine cannot hold is a result too
            results[str(size)] = {"failed": f"{type(failure).__name__}: {failure}"}
        if not args.quick:  # each size as it ends: a later one that runs out of memory loses nothing
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    header = ("| GB per node | to safe (memory, 2 nodes) s | to memory s | to node disk s | to S3 moto s | "
              "to S3 rclone s | memory tier to durable (moto) s | stall / 50 steps | restore from peer s | "
              "restore from S3 s |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    print(header)
    for size, figures in results.items():
        print(_row(float(size), figures) if "failed" not in figures else f"| {size} | failed: {figures['failed']} |")
    if not args.quick:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

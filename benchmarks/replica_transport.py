"""Which channel carries a node's checkpoint share to its peer: a gloo group or plain TCP.

Two processes on loopback, each holding a file of ``--gib`` GiB in tmpfs (/dev/shm), send
it to each other at once, as the two nodes of the memory tier's ring do after a save:

* ``gloo``: a process group of its own (``dist.new_group``), ``isend``/``irecv`` of the
  file's bytes as a uint8 tensor read from tmpfs, the received tensor written to tmpfs;
* ``tcp``: skylift's :func:`~skylift.checkpoint.replica.send_step` to the other process's
  :class:`~skylift.checkpoint.replica.ReplicaReceiver` (what ``checkpoint.memory`` uses).

Seconds from the start until both copies are in the other process's tmpfs, the slower
rank's; ``--repeats`` rounds each, alternating, medians reported.

    python -m benchmarks.replica_transport [--gib 1] [--repeats 3]
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

RESULTS = Path(__file__).parent / "results" / "replica_transport.json"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker(rank: int, port: int, gib: float, repeats: int, folder: str, out: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from skylift.checkpoint.manifest import Manifest, file_entry
    from skylift.checkpoint.replica import ReplicaReceiver, send_step
    from skylift.storage.local import LocalStore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    side = dist.new_group(backend="gloo")
    peer = 1 - rank
    size = int(gib * 2**30)
    own = LocalStore(Path(folder) / f"node{rank}")
    payload = np.random.default_rng(rank).integers(0, 255, size, dtype=np.uint8).tobytes()
    own.write_bytes("step-1/shard.bin", payload)
    manifest = Manifest.create(1, 2, {"shard.bin": file_entry(payload[:16])}).encode()  # names only matter here
    del payload
    received = LocalStore(Path(folder) / f"from{peer}-at{rank}")
    receiver = ReplicaReceiver(received, "127.0.0.1", 0, timeout_s=600)
    peers: list[Any] = [None, None]
    dist.all_gather_object(peers, receiver.peer)

    def by_gloo() -> float:
        dist.barrier()
        started = time.perf_counter()
        data = torch.from_numpy(np.fromfile(own.path("step-1/shard.bin"), dtype=np.uint8))
        incoming = torch.empty(size, dtype=torch.uint8)
        works = [dist.isend(data, peer, group=side), dist.irecv(incoming, peer, group=side)]
        for work in works:
            work.wait()
        received.write_bytes("step-1/gloo.bin", incoming.numpy().tobytes())
        return time.perf_counter() - started

    def by_tcp() -> float:
        dist.barrier()
        received.delete_prefix("step-1")
        dist.barrier()
        started = time.perf_counter()
        send_step(own, 1, manifest, ["shard.bin"], peers[peer], timeout_s=600)
        dist.barrier()  # both copies stored
        return time.perf_counter() - started

    times: dict[str, list[float]] = {"gloo": [], "tcp": []}
    for round_ in range(repeats):
        order = ("gloo", "tcp") if round_ % 2 == 0 else ("tcp", "gloo")
        for name in order:
            elapsed = by_gloo() if name == "gloo" else by_tcp()
            slowest: list[Any] = [None, None]
            dist.all_gather_object(slowest, elapsed)
            times[name].append(max(slowest))
    receiver.close()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    from benchmarks.common import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    folder = f"/dev/shm/skylift-transport-{uuid.uuid4().hex[:8]}"
    scratch = tempfile.mkdtemp()
    out = os.path.join(scratch, "times.json")
    try:
        mp.spawn(worker, args=(_free_port(), args.gib, args.repeats, folder, out), nprocs=2)
        times = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.gib} GiB each way, both at once: gloo {medians['gloo']:.2f} s, tcp {medians['tcp']:.2f} s "
          f"(tcp / gloo {medians['tcp'] / medians['gloo']:.2f})")
    report = {"config": {**environment(1, ("torch",)), "gib": args.gib, "repeats": args.repeats,
                         "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg()},
              "results": {"seconds": times, "median_s": medians}}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

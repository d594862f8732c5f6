"""Real gloo process groups for tests that spawn their own ranks (``torch.multiprocessing``).

The test process holds the group's TCPStore on a port the kernel assigned, and the ranks
join it as clients. Probing for a free port and closing it before rank 0 binds it leaves a
window in which another process (the other xdist worker starts hundreds) can take the
port: rank 0 then fails to bind, and rank 1 reaches a stranger's store and joins its job.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"


def spawn_ranks(worker: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``worker(rank, world_size, port, *args)`` on ``world_size`` spawned processes;
    each calls :func:`join` first.

    Raises:
        torch.multiprocessing.ProcessExitedException: a rank died (the others are stopped).
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(worker, args=(world_size, store.port, *args), nprocs=world_size, join=True,
                           start_method="spawn")
    finally:
        del store


def join(rank: int, world_size: int, port: int) -> None:
    """Join the group whose store :func:`spawn_ranks` holds on ``port``, over gloo."""
    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts (a C++ terminate in gloo) prints every thread's stack
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    store = dist.TCPStore(HOST, port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)

"""Real gloo process groups for tests that spawn their own ranks (``torch.multiprocessing``).

The test process holds the group's TCPStore on a port the kernel assigned, and the ranks
join it as clients. Probing for a free port and closing it before rank 0 binds it leaves a
window in which another process (the other xdist worker starts hundreds) can take the
port: rank 0 then fails to bind, and rank 1 reaches a stranger's store and joins its job.

A rank that finished its work ends as skylift's own workers end
(:func:`skylift.loop.distributed.exit_cleanly`), never through the interpreter's teardown.
A spawned process otherwise returns through ``sys.exit``: Python finalizes while gloo's
worker threads live on (``destroy_process_group`` does not join the threads of a group
that is still referenced, and FSDP's meshes and skylift's sessions hold theirs), and a
worker that drops the last reference to a Python-owned tensor after finalization began
takes the GIL, which ends the thread with ``pthread_exit``; its forced unwind through a
``noexcept`` destructor is ``std::terminate``: "terminate called without an active
exception", SIGABRT. On a busy machine the worker is scheduled late enough for that
(tests/test_gloo_exit.py makes it certain and checks both endings).
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
        mp.start_processes(_rank, args=(worker, world_size, store.port, *args), nprocs=world_size, join=True,
                           start_method="spawn")
    finally:
        del store


def _rank(rank: int, worker: Callable[..., None], world_size: int, port: int, *args: Any) -> None:
    """One spawned rank: the worker, then (if it returned) the end a skylift worker has. A
    worker that raised leaves through torch.multiprocessing, which reports its traceback."""
    from skylift.loop.distributed import exit_cleanly

    worker(rank, world_size, port, *args)
    exit_cleanly(0)


def join(rank: int, world_size: int, port: int, timeout_s: float | None = None) -> None:
    """Join the group whose store :func:`spawn_ranks` holds on ``port``, over gloo (its
    collectives time out after ``timeout_s``, torch's default when ``None``)."""
    import datetime

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts (a C++ terminate in gloo) prints every thread's stack
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    store = dist.TCPStore(HOST, port, world_size, is_master=False)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)

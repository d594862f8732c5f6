"""Why spawned ranks end through :func:`skylift.loop.distributed.exit_cleanly`, and that
:func:`tests.gloo_group.spawn_ranks` does.

A gloo worker thread that drops the last reference to a Python-owned tensor after the
interpreter began finalizing aborts the process: the thread takes the GIL, CPython ends it
with ``pthread_exit``, and the forced unwind meets a ``noexcept`` destructor
(``AsyncAllreduceWork::~AsyncAllreduceWork``): ``std::terminate``, "terminate called
without an active exception". On a loaded machine the worker runs late by chance. Here it
is made certain: each rank runs on one core with gloo's threads at ``SCHED_IDLE``, so they
run only while the main thread waits; the main thread does not wait between its last
collective and the interpreter's teardown, and an object it leaves behind waits there.
"""

from __future__ import annotations

import os
import time

import pytest
import torch.multiprocessing as mp

from tests.gloo_group import join, spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # two pairs of spawned torch processes


class _WaitsAtTeardown:
    """Left in a module global: its finalizer runs, and waits, during the interpreter's teardown."""

    def __del__(self, sleep=time.sleep) -> None:  # bound now: the teardown clears the module's globals
        sleep(1.0)


_left_behind: list[object] = []


def _rank_with_gloo_threads_behind(rank: int, world_size: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the threads made from here share one core
    torch.set_num_threads(1)
    join(rank, world_size, port)
    group = dist.new_group(backend="gloo")
    for task in os.listdir("/proc/self/task"):
        if int(task) != os.getpid():
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
    for _ in range(10):
        dist.all_reduce(torch.ones(64), group=group)  # the tensor's Python object dies at once
    _left_behind.extend([group, _WaitsAtTeardown()])


def _rank_as_torch_multiprocessing_ends_it(rank: int, world_size: int, port: int) -> None:
    _rank_with_gloo_threads_behind(rank, world_size, port)


def _ranks_ended_by_torch_multiprocessing() -> str | None:
    """Two ranks that end through ``sys.exit`` and the teardown; the signal that ended one, if any."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    try:
        mp.start_processes(_rank_as_torch_multiprocessing_ends_it, args=(2, store.port), nprocs=2, join=True,
                           start_method="spawn")
    except mp.ProcessExitedException as ended:
        return ended.signal_name
    return None


def test_a_rank_left_to_the_interpreters_teardown_aborts_when_gloo_frees_a_tensor_late():
    # Measured here: 3 pairs of 4 aborted. The main thread may still wait once on its way
    # out before the teardown (giving the worker the core in time), so up to 6 pairs.
    signals = []
    while len(signals) < 6 and "SIGABRT" not in signals:
        signals.append(_ranks_ended_by_torch_multiprocessing())
    assert "SIGABRT" in signals, signals


def test_spawn_ranks_ends_each_rank_before_the_teardown_so_none_aborts():
    for _ in range(3):
        spawn_ranks(_rank_with_gloo_threads_behind, 2)

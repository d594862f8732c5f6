"""skylift's own workers, forked from one process that has imported torch and the trainer.

torchrun starts each worker as a new Python that imports torch, dynamo and the trainer:
about 3.2 CPU-s before the first step (measured on 2 cores), paid by every local rank at
the same moment and again by every worker an elastic restart starts. ``skylift run``'s
worker is skylift's own code, so it is started as a function instead, through torchrun's
``elastic_launch`` with the ``forkserver`` start method (torch's documented path for a
function entrypoint): one server process imports what :data:`PRELOAD` names, never touches
CUDA, and each worker is a fork of it. A user's script (``skylift launch``) still starts as
its own Python, as torchrun starts it.

A forked worker starts from the server's state, so the few things a fresh Python takes from
its parent at start are handed over explicitly at each start: the launcher's environment as
it is then (an elastic restart sets the reason in it), its stdout and stderr, and the thread
count. The exit code is the worker's own, as before: 143 still means "preempted, saved".
"""

from __future__ import annotations

import importlib
import io
import logging
import multiprocessing
import os
import sys
from typing import Any, cast

__all__ = ["PRELOAD", "WORKER_NAME_PREFIX", "PreloadedWorker", "start_server"]

WORKER_NAME_PREFIX = "skylift-rank"
"""A worker's process name (``ps``, ``top``) is this and its global rank: a fork keeps the
server's command line, which names no rank."""

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.elastic.multiprocessing.errors", "skylift.train.trainer")
"""What the server imports once. ``torch._dynamo`` because torch.optim imports it on first
use (1.4 CPU-s of the 3.2); nothing here initialises CUDA, which a fork could not inherit."""


def start_server(module: str) -> None:
    """Start the fork server (once per launcher process) with :data:`PRELOAD` and ``module``.

    Started before the rendezvous so its imports overlap the launcher's own waiting.
    """
    from multiprocessing import forkserver

    # Not '__main__', multiprocessing's default: the launcher's main module is skylift's CLI.
    forkserver.set_forkserver_preload([*PRELOAD, module])
    forkserver.ensure_running()
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(existing, _ExitWithoutTraceback) for existing in agent_log.filters):
        agent_log.addFilter(_ExitWithoutTraceback())


class _ExitWithoutTraceback(logging.Filter):
    """torch logs a function worker's non-zero exit with the traceback of its own poll (a
    ``ProcessExitedException``), where it gives a worker started as a program one line. The
    line (exit code, rank, pid) stays; the traceback, which says nothing of the worker, goes.
    A worker's own exception (``ProcessRaisedException``) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and type(record.exc_info[1]).__name__ == "ProcessExitedException":
            record.exc_info = record.exc_text = None
        return True


class PreloadedWorker:
    """torch's entrypoint for a worker that runs ``module.main(argv)`` (an exit code).

    Pickled at each worker's start, it carries the launcher's environment and stdio as they
    are then; unpickled in the forked child, before torch's wrapper sets the rank's own
    variables and any redirect, it puts them in place.
    """

    def __init__(self, module: str) -> None:
        self.module = module
        self.__qualname__ = self.__name__ = module  # torch's agent logs the entrypoint by name

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.reduction import DupFd

        sys.stdout.flush()
        sys.stderr.flush()
        # Descriptors 1 and 2, what a program the launcher started would inherit.
        return {"module": self.module, "environment": dict(os.environ), "stdout": DupFd(1), "stderr": DupFd(2)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import gc

        # The server's heap stays out of this worker's garbage collections: walking it would
        # write to every page the fork shares with the server (copy-on-write), for objects
        # the imports keep alive anyway.
        gc.freeze()
        type(self).__init__(self, state["module"])
        os.environ.clear()
        os.environ.update(state["environment"])
        for target, inherited in ((1, state["stdout"]), (2, state["stderr"])):
            descriptor = inherited.detach()
            os.dup2(descriptor, target)
            os.close(descriptor)
        # As torchrun's `python -u`: a line a worker prints reaches the log when printed.
        for stream in (sys.stdout, sys.stderr):
            cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True, write_through=True)

    def __call__(self, *argv: str) -> None:
        import torch

        from skylift.loop.distributed import close_process_group

        _name_process(f"{WORKER_NAME_PREFIX}{os.environ.get('RANK', '')}")
        # multiprocessing made the server's method this process's default as it started it; a
        # fresh Python's is the platform's (fork on Linux before 3.14), which a DataLoader's
        # workers rely on to take a recipe's local functions without pickling them.
        multiprocessing.set_start_method(None, force=True)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))  # the server's OpenMP read the variable once, at its import
        sys.argv = [self.module, *argv]
        code = importlib.import_module(self.module).main(list(argv))
        close_process_group(code)
        if code:
            raise SystemExit(code)  # the process's exit code, as a worker's own Python would end


def _name_process(name: str) -> None:
    """Set the name ``ps`` and ``top`` show (Linux: at most 15 bytes; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    set_name = 15  # PR_SET_NAME
    ctypes.CDLL(None, use_errno=True).prctl(set_name, name.encode()[:15], 0, 0, 0)

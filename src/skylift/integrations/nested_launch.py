"""``accelerate launch`` inside a ``skylift launch`` worker runs the script in that worker.

TRL's command line (``trl sft``, ``trl dpo``, ...) always re-launches its training script
through ``accelerate launch`` (``trl/cli/accelerate_launcher.py``), and Axolotl's starts
``accelerate launch`` as a subprocess. Under ``skylift launch --nproc N`` every worker
already is one rank of a formed world (torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of the launcher's store). Left alone, each worker starts
a second generation of processes that inherit those variables and form a *second* group
of the same ranks on the same store. With TRL on 2 CPU processes that hangs for ever:
the CLI process has already formed the group while parsing its arguments
(``TrainingArguments(use_cpu=True)`` builds accelerate's ``PartialState``), so the
children read the parents' gloo addresses from the store, rank 0's child connects to
rank 1's *parent*, and the first barrier never completes (measured with ``py-spy`` and
``ss``: the parents hold the gloo pair, the children wait in ``barrier``).

:func:`patch_accelerate_launch` replaces accelerate's local launchers (the simple, the
multi-GPU and the DeepSpeed one) with one that, inside a skylift worker, applies the
variables accelerate would have given its child (mixed precision, dynamo, FSDP and
DeepSpeed settings; never torchrun's rank and rendezvous variables) and runs the script
in this process, as ``python script.py`` would. The world is skylift's: ``--nproc`` and
``--nnodes`` decide it, and a different ``--num_processes`` is said once, not obeyed.
Outside a skylift worker accelerate is left as it is.
"""

from __future__ import annotations

import functools
import importlib
import os
import runpy
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["inside_skylift_world", "patch_accelerate_launch", "run_in_this_process"]

_WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "MASTER_ADDR", "MASTER_PORT")
"""torchrun's description of the formed world: accelerate's child variables never replace these."""

_IN_PROCESS = {"simple_launcher": "prepare_simple_launcher_cmd_env", "multi_gpu_launcher": "prepare_multi_gpu_env",
               "deepspeed_launcher": "prepare_deepspeed_cmd_env"}
"""accelerate's launchers that start local processes, and the function that computes their environment."""


def inside_skylift_world(environ: Mapping[str, str] | None = None) -> bool:
    """True in a process that ``skylift launch`` started (or one of its descendants)
    while torchrun's world is formed around it."""
    from skylift.loop.lifeline import LAUNCHER_PID_VARIABLE

    environ = os.environ if environ is None else environ
    return bool(environ.get(LAUNCHER_PID_VARIABLE)) and all(environ.get(name) for name in ("RANK", "WORLD_SIZE"))


def patch_accelerate_launch(module: ModuleType) -> None:
    """Wrap ``module``'s (``accelerate.commands.launch``) local launchers once."""
    for launcher_name, environment_name in _IN_PROCESS.items():
        original = getattr(module, launcher_name, None)
        if original is None or getattr(original, "_skylift_in_process", False):
            continue
        module_of_environment = importlib.import_module("accelerate.utils.launch")  # where accelerate's are
        wrapped = _in_process_launcher(original, getattr(module_of_environment, environment_name))
        wrapped._skylift_in_process = True  # type: ignore[attr-defined]
        setattr(module, launcher_name, wrapped)


def _in_process_launcher(original: Callable[[Any], None], prepare: Callable[[Any], Any]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def launcher(args: Any) -> None:
        if not inside_skylift_world() or getattr(args, "no_python", False):
            return original(args)
        prepared = prepare(args)
        child_environment = prepared[1] if isinstance(prepared, tuple) else prepared
        run_in_this_process(args, child_environment)
        return None

    return launcher


def run_in_this_process(args: Any, child_environment: Mapping[str, str]) -> None:
    """The script of ``accelerate launch``'s ``args`` as ``__main__`` of this process, with
    the variables accelerate would have given its child (torchrun's world stays)."""
    script, script_args = args.training_script, list(args.training_script_args)
    _say(script, getattr(args, "num_processes", None))
    os.environ.update({name: value for name, value in child_environment.items()
                       if name not in _WORLD_VARIABLES and os.environ.get(name) != value})
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if getattr(args, "module", False):
            sys.argv = [script, *script_args]
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *script_args]
            sys.path.insert(0, os.path.dirname(os.path.realpath(script)))  # as `python script.py` would
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _say(script: str, asked_processes: Any) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    world_size = int(os.environ["WORLD_SIZE"])
    line = (f"skylift: accelerate launch inside a skylift worker: {os.path.basename(script)} runs in each of the "
            f"{world_size} worker(s) skylift started (a nested launch would form a second process group on the same "
            "rendezvous)")
    try:
        asked = int(asked_processes) if asked_processes is not None else None
    except (TypeError, ValueError):
        asked = None
    if asked is not None and asked not in (1, world_size):
        line += f"; accelerate's --num_processes {asked} is not used: skylift launch --nproc/--nnodes set the world"
    print(line, file=sys.stderr, flush=True)

"""Runs a user's program as ``__main__`` inside a torchrun worker, then exits cleanly.

    python -m skylift.cli.shim script.py args...
    python -m skylift.cli.shim -m package.module args...

As ``python script.py`` would, it puts the script's own folder first on ``sys.path`` (a
sibling import works from any working folder); ``-m`` keeps the working folder, as
``python -m`` does. Before the program's first line the worker is tied to its launcher
(:mod:`skylift.loop.lifeline`) and, unless ``SKYLIFT_ATTACH=0``, skylift's callback is
attached to every Trainer the program builds (:mod:`skylift.integrations.attach`).
A skylift error (a run lease held by another job, say) is one line, on rank 0 only.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from skylift.errors import SkyliftError
from skylift.loop.distributed import exit_cleanly
from skylift.loop.lifeline import die_with_launcher

EXIT_SKYLIFT_ERROR = 2
"""A skylift error stopped the program (as a config error stops ``skylift``)."""


def run_user_code(argv: list[str]) -> int:
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runner = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        # python puts the script's folder (symbolic links resolved) where -m's shim had the working folder.
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runner = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
    try:
        runner()
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except SkyliftError as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"skylift: error: {error}", file=sys.stderr)
        return EXIT_SKYLIFT_ERROR
    except BaseException:  # noqa: BLE001 - as python itself: any end of the user's script, Ctrl-C too, is a traceback
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str]) -> int:
    die_with_launcher()
    from skylift.integrations.attach import attach_enabled, install

    install(trainers=attach_enabled())  # accelerate's nested launch is handled even with --no-attach
    return run_user_code(argv)


if __name__ == "__main__":
    exit_cleanly(main(sys.argv[1:]))

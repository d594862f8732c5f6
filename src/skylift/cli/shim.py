"""Runs a user's script as ``__main__`` inside a torchrun worker, then exits cleanly.

    python -m skylift.cli.shim script.py args...
    python -m skylift.cli.shim -m package.module args...
"""

from __future__ import annotations

import runpy
import sys
import traceback

from skylift.loop.distributed import exit_cleanly


def run_user_code(argv: list[str]) -> int:
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runner = lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
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
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    exit_cleanly(run_user_code(sys.argv[1:]))

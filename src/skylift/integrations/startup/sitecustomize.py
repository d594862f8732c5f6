"""Python runs this file at start-up in every process ``skylift launch`` starts and in
their Python descendants: the launcher puts this folder first on the workers'
``PYTHONPATH`` (:func:`skylift.integrations.attach.startup_path`), so the attach reaches
the training script that ``trl sft``, ``axolotl train`` or ``accelerate launch`` start
in a child process. Nothing is installed into site-packages; a Python started outside
``skylift launch`` never sees this folder.

Start-up cost: importing skylift here would cost tens of milliseconds, so this file
imports nothing beyond what the interpreter has loaded. It puts one finder on
``sys.meta_path`` that compares an imported name with three; only when the program
imports ``transformers``, ``lightning`` or ``accelerate`` does it import
:mod:`skylift.integrations.attach` and install the hook. Then it runs the
``sitecustomize`` this one shadows, if any (a distribution's, a virtualenv's, a test
suite's), as Python would have.
"""

import os
import sys

_FOLDER = os.path.dirname(os.path.abspath(__file__))

TRIGGERS = frozenset(("transformers", "lightning", "accelerate"))
"""The top-level packages of the modules :mod:`skylift.integrations.attach` patches."""


class SkyliftAttachTrigger:
    """Finds nothing; the first import of a trigger package installs skylift's hook."""

    armed = True

    def find_spec(self, fullname, path=None, target=None):
        if self.armed and fullname in TRIGGERS:
            self.armed = False
            try:
                from skylift.integrations.attach import attach_enabled, install
            except ImportError:  # a different Python, without skylift, started by the program: not ours to touch
                return None
            install(trainers=attach_enabled())
        return None


def _run_the_shadowed_sitecustomize():
    # The import system's own PathFinder (a class on sys.meta_path): importing importlib.machinery would cost ~5 ms.
    path_finder = next((finder for finder in sys.meta_path if getattr(finder, "__name__", "") == "PathFinder"), None)
    if path_finder is None:
        return
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _FOLDER]
    spec = path_finder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = type(sys)(spec.name)
    module.__spec__, module.__file__, module.__loader__ = spec, spec.origin, spec.loader
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if not any(type(finder).__name__ == "SkyliftAttachTrigger" for finder in sys.meta_path):
    sys.meta_path.insert(0, SkyliftAttachTrigger())
_run_the_shadowed_sitecustomize()

"""Zero-line attach: skylift's callback in every Trainer a launched program builds.

``skylift launch`` runs each worker through :mod:`skylift.cli.shim`, which calls
:func:`install` before the program's first line, and puts :data:`STARTUP_FOLDER` first
on the workers' ``PYTHONPATH``: its ``sitecustomize.py`` installs the same hook in any
Python process a worker starts (``trl sft`` and ``axolotl train`` re-launch through
``accelerate launch``), at the first import of ``transformers``, ``lightning`` or
``accelerate``. ``--no-attach`` (``SKYLIFT_ATTACH=0``) leaves the Trainers alone.
:func:`install` puts one finder first on ``sys.meta_path`` that
does nothing but look a module's name up in a dict of two, so a program that imports
neither ``transformers`` nor ``lightning`` pays one dict lookup per import. When
``transformers.trainer`` or ``lightning.pytorch.trainer.trainer`` is executed, the
finder patches that module's ``Trainer`` once:

* ``Trainer.train()`` (Hugging Face, every subclass: TRL's ``SFTTrainer``, Axolotl's,
  LLaMA-Factory's) adds :class:`skylift.integrations.transformers.SkyliftCallback`
  unless one is there, and resumes from the newest *complete* ``checkpoint-N/``
  unless the program passed a checkpoint of its own;
* ``Trainer.fit()`` (Lightning) does the same with
  :class:`skylift.integrations.lightning.SkyliftCallback` and ``ckpt_path``.

Nothing is installed into site-packages: the finder lives only in the processes the
shim starts. Rank 0 says once per library what was attached.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["ATTACH_VARIABLE", "attach_enabled", "install", "startup_path", "uninstall", "with_startup_path"]

ATTACH_VARIABLE = "SKYLIFT_ATTACH"
"""``0`` turns the attach off (``skylift launch --no-attach`` sets it)."""

_said: set[str] = set()

STARTUP_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
"""Holds the ``sitecustomize.py`` that installs the hook in every Python process that
``skylift launch`` starts and in their Python children."""


def startup_path() -> str:
    return STARTUP_FOLDER


def with_startup_path(python_path: str | None) -> str:
    """``PYTHONPATH`` with the startup folder first (once)."""
    entries = [entry for entry in (python_path or "").split(os.pathsep) if entry and entry != STARTUP_FOLDER]
    return os.pathsep.join([STARTUP_FOLDER, *entries])


def attach_enabled(environ: Any = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(ATTACH_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch on the executed module."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ... for tracebacks
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; for the patched modules it wraps the real finder's loader."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install(*, trainers: bool = True) -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent); patch what is already imported.

    ``accelerate launch`` inside a skylift worker always runs its script in the worker
    (:mod:`skylift.integrations.nested_launch`); ``trainers=False`` (``--no-attach``)
    leaves the Trainers alone.
    """
    if any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        return
    patches: dict[str, Callable[[ModuleType], None]] = {"accelerate.commands.launch": _patch_accelerate}
    if trainers:
        patches.update({"transformers.trainer": _patch_transformers,
                        "lightning.pytorch.trainer.trainer": _patch_lightning})
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(patches))


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterImport)]


def _say(library: str, line: str) -> None:
    if library in _said or os.environ.get("RANK", "0") != "0":
        return
    _said.add(library)
    print(f"skylift: {line} (skylift launch --no-attach or SKYLIFT_ATTACH=0 turns this off)",
          file=sys.stderr, flush=True)


def _patch_accelerate(module: ModuleType) -> None:
    from skylift.integrations.nested_launch import patch_accelerate_launch

    patch_accelerate_launch(module)


# -- Hugging Face ------------------------------------------------------------------------


def _patch_transformers(module: ModuleType) -> None:
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None or getattr(trainer_class.train, "_skylift_attached", False):
        return
    original = trainer_class.train
    position = _parameter_position(original, "resume_from_checkpoint")

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _with_resume(args, kwargs, "resume_from_checkpoint", position,
                                    lambda passed: _attach_to_transformers(self, passed))
        return original(self, *args, **kwargs)

    train._skylift_attached = True  # type: ignore[attr-defined]
    trainer_class.train = train


def _attach_to_transformers(trainer: Any, passed: Any) -> Any:
    from skylift.integrations.transformers import SkyliftCallback, resume_checkpoint

    name = type(trainer).__name__
    if not any(isinstance(callback, SkyliftCallback) for callback in trainer.callback_handler.callbacks):
        trainer.add_callback(SkyliftCallback())
        what = f"attached SkyliftCallback to {name}"
    else:
        what = f"{name} already has a SkyliftCallback"
    if passed is None or passed is True:  # True: "the newest", which must be a complete one
        found = resume_checkpoint(trainer)
        resume = found if found is not None else (None if passed is None else passed)
        _say("transformers",
             f"{what}; " + (f"resuming from {found}" if found else "no complete checkpoint: fresh start"))
        return resume
    _say("transformers", f"{what}; the program's own resume_from_checkpoint={passed!r} stays")
    return passed


# -- Lightning -----------------------------------------------------------------------------


def _patch_lightning(module: ModuleType) -> None:
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None or getattr(trainer_class.fit, "_skylift_attached", False):
        return
    original = trainer_class.fit
    position = _parameter_position(original, "ckpt_path")

    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _with_resume(args, kwargs, "ckpt_path", position,
                                    lambda passed: _attach_to_lightning(self, passed))
        return original(self, *args, **kwargs)

    fit._skylift_attached = True  # type: ignore[attr-defined]
    trainer_class.fit = fit


def _attach_to_lightning(trainer: Any, passed: Any) -> Any:
    from skylift.integrations.lightning import SkyliftCallback, resume_checkpoint

    if not any(isinstance(callback, SkyliftCallback) for callback in trainer.callbacks):
        trainer.callbacks.append(SkyliftCallback())
        what = "attached SkyliftCallback to the Lightning Trainer"
    else:
        what = "the Lightning Trainer already has a SkyliftCallback"
    if passed is None:
        found = resume_checkpoint(trainer)
        _say("lightning", f"{what}; " + (f"resuming from {found}" if found else "no complete checkpoint: fresh start"))
        return found
    _say("lightning", f"{what}; the program's own ckpt_path={passed!r} stays")
    return passed


# -- parts ---------------------------------------------------------------------------------


def _parameter_position(function: Callable[..., Any], name: str) -> int | None:
    """The index of ``name`` among the positional arguments after ``self``."""
    names = [parameter.name for parameter in inspect.signature(function).parameters.values()
             if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)][1:]
    return names.index(name) if name in names else None


def _with_resume(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int | None,
                 choose: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the resume argument replaced by ``choose(passed)``."""
    if position is not None and len(args) > position:
        return (*args[:position], choose(args[position]), *args[position + 1:]), kwargs
    return args, {**kwargs, name: choose(kwargs.get(name))}

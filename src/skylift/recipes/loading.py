"""Your own code by import path: ``package.module:Name`` or ``/path/to/file.py:Name``.

A module path is imported with the config's folder and the working directory on the
search path (after what is already there); a file path is loaded as a module of its
own under a stable name, so DataLoader workers and every torchrun rank find the same
objects. A failure names the path, the search path used and the error.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError

__all__ = ["load_object"]


def load_object(path: str, *, field: str) -> Any:
    """The object ``path`` names; raises :class:`SkyliftConfigError` about ``field``."""
    module_name, _, attribute = path.rpartition(":")
    search_path = [os.getcwd(), *sys.path]
    try:
        module = _import_file(Path(module_name)) if module_name.endswith(".py") else _import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure of the user's code is reported as such
        where = "file" if module_name.endswith(".py") else "module"
        raise SkyliftConfigError(
            f"{field}: cannot import the {where} {module_name!r} of {path!r}: {type(error).__name__}: {error}",
            hint="Module search path used: " + os.pathsep.join(search_path)
            + f"\nFix the import, then check it with: python -c \"import {module_name.removesuffix('.py')}\"",
        ) from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        names = sorted(name for name in vars(module) if not name.startswith("_"))
        raise SkyliftConfigError(
            f"{field}: {module_name!r} has no {attribute!r} (it defines: {', '.join(names[:20])})"
        ) from None


def _import_module(name: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # `skylift` as a console script does not put it there
    return importlib.import_module(name)


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {file}")
    resolved = file.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    name = f"skylift_user_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    if str(resolved.parent) not in sys.path:
        sys.path.append(str(resolved.parent))  # its own sibling imports
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module

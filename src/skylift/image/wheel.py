"""The wheel of the skylift that is running, written into an image's build context.

skylift is on no package index yet, so an image cannot ``pip install skylift``: ``skylift
dockerfile`` writes this wheel beside the project and the Dockerfile installs it, pinned by
the project's constraints. The image then runs the same skylift as the machine that wrote
the Dockerfile.

The wheel is packed from the installed package, not built from a source tree, so it works
the same for a wheel install (no source at hand) and an editable one: the package folder
as it is imported (its Python files and package data, no ``__pycache__``) and the installed
distribution's own ``METADATA`` (name, version, ``Requires-Dist``) and entry points. Every
file gets the zip epoch (1980-01-01) as its time, so the same skylift gives the same bytes
and Docker's layer cache holds.
(Wheel format: https://packaging.python.org/en/latest/specifications/binary-distribution-format/)
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from importlib import metadata
from pathlib import Path

from skylift.errors import SkyliftConfigError

__all__ = ["WHEEL_FOLDER", "wheel_name", "write_skylift_wheel"]

WHEEL_FOLDER = "skylift-wheel"
"""Where in the build context (the project folder) the wheel is written."""

_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_SKIPPED_PARTS = {"__pycache__"}
_SKIPPED_SUFFIXES = {".pyc", ".pyo"}


def wheel_name(version: str) -> str:
    """The wheel's file name for skylift ``version`` (pure Python: ``py3-none-any``)."""
    return f"skylift-{version}-py3-none-any.whl"


def write_skylift_wheel(folder: Path) -> Path:
    """Write the running skylift as a wheel into ``folder``; return its path.

    Raises:
        SkyliftConfigError: skylift runs from a source folder without being installed,
            so there is no ``METADATA`` naming its dependencies.
    """
    import skylift

    package = Path(skylift.__file__).resolve().parent
    try:
        distribution = metadata.distribution("skylift")
    except metadata.PackageNotFoundError:
        raise SkyliftConfigError(
            f"skylift runs from {package} without being installed, so its wheel has no dependency list",
            hint="Install it first (pip install -e . in its checkout, or pip install the wheel).",
        ) from None
    if distribution.version != skylift.__version__:
        raise SkyliftConfigError(
            f"the installed skylift distribution is {distribution.version} but the running package "
            f"({package}) is {skylift.__version__}",
            hint="Reinstall skylift (pip install -e . in its checkout) so the two agree.",
        )
    dist_info = f"skylift-{skylift.__version__}.dist-info"
    entries: list[tuple[str, bytes]] = [
        (f"skylift/{path.relative_to(package).as_posix()}", path.read_bytes()) for path in _package_files(package)
    ]
    entries.append((f"{dist_info}/METADATA", (distribution.read_text("METADATA") or "").encode()))
    entries.append((f"{dist_info}/WHEEL", _WHEEL_FILE.encode()))
    entry_points = distribution.read_text("entry_points.txt")
    if entry_points:
        entries.append((f"{dist_info}/entry_points.txt", entry_points.encode()))
    record = "".join(f"{name},sha256={_digest(data)},{len(data)}\n" for name, data in entries)
    entries.append((f"{dist_info}/RECORD", (record + f"{dist_info}/RECORD,,\n").encode()))

    folder.mkdir(parents=True, exist_ok=True)
    target = folder / wheel_name(skylift.__version__)
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    partial.replace(target)  # a build never sees half a wheel
    return target


_WHEEL_FILE = "Wheel-Version: 1.0\nGenerator: skylift dockerfile\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def _package_files(package: Path) -> list[Path]:
    return sorted(
        path
        for path in package.rglob("*")
        if path.is_file()
        and not _SKIPPED_PARTS.intersection(path.relative_to(package).parts)
        and path.suffix not in _SKIPPED_SUFFIXES
    )


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

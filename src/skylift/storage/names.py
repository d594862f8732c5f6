"""Names read from an index, a manifest or a listing stay inside their dataset or checkpoint.

A dataset's ``index.json`` or a checkpoint's ``manifest.json`` comes from wherever the
user points skylift, and each name in it becomes a local path or an object key. Joined
unchecked, ``../../site-packages/evil.pth`` (with its true size and sha256, so every
hash check passes) is written beside the cache, and a ``.pth`` file runs on the next
Python start. So every reader checks each name here before using it: a refused name
stops the read before a byte is written, naming the file it came from.
"""

from __future__ import annotations

from skylift.storage.errors import StoragePermanentError

__all__ = ["UnsafeNameError", "check_file_name", "check_relative_name"]


class UnsafeNameError(StoragePermanentError, ValueError):
    """A name read from an index, manifest or listing would leave its folder."""


def _problem(name: object, *, plain: bool, hidden_allowed: bool = True) -> str | None:
    """Why ``name`` is not safe to join under a folder, or ``None`` if it is."""
    if not isinstance(name, str):
        return f"it is a {type(name).__name__}, not a string"
    if not name:
        return "it is empty"
    if any(ord(character) < 32 or character == "\x7f" for character in name):
        return "it holds a control character"
    if "\\" in name:
        return "it holds a backslash"
    if name.startswith("/"):
        return "it is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "it climbs out with a '..' path segment"
    if plain and len(parts) > 1:
        return "it holds a '/'"
    if "." in parts:
        return "it holds a '.' path segment"
    if "" in parts:
        return "it holds an empty path segment"
    if not hidden_allowed and name.startswith("."):
        return "it starts with '.', as the reader's own bookkeeping files do"
    return None


def check_file_name(name: object, *, where: str, what: str, fix: str, hidden_allowed: bool = True) -> str:
    """``name`` if it is a plain file name (no ``/``), else :class:`UnsafeNameError`.

    Args:
        where: the file the name was read from (``s3://bucket/data/index.json``).
        what: what the name is (``shard name``), for the message.
        fix: the sentence that says what to do.
        hidden_allowed: ``False`` refuses a leading ``.`` too (where the reader keeps
            hidden files of its own beside the named ones, as the shard cache does).
    """
    problem = _problem(name, plain=True, hidden_allowed=hidden_allowed)
    if problem is not None:
        raise UnsafeNameError(f"{where}: {what} {name!r} is not a plain file name ({problem}); refused before "
                              f"anything was written. {fix}")
    return name  # type: ignore[return-value]  # _problem checked it is a str


def check_relative_name(name: object, *, where: str, what: str, fix: str) -> str:
    """``name`` if it is a ``/``-separated relative path of plain names (no ``.``, ``..``,
    empty segment, backslash or control character), else :class:`UnsafeNameError`."""
    problem = _problem(name, plain=False)
    if problem is not None:
        raise UnsafeNameError(f"{where}: {what} {name!r} is not a relative path inside it ({problem}); refused "
                              f"before anything was written. {fix}")
    return name  # type: ignore[return-value]

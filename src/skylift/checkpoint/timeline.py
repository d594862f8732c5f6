"""Timelines: which checkpoints a run continues after a rollback or a fresh start.

A run that resumes from step N while newer checkpoints exist starts a new timeline that
forks from N: an explicit ``checkpoint.resume`` of an older step (a rollback), or
``auto`` passing over newer checkpoints proven corrupt (or all of them: a fresh start).
The newer checkpoints of the old timeline are abandoned: auto-resume never returns to
them, and retention removes them at the new timeline's first commit. Not before: a
rollback killed before its first save has lost nothing, and can still be undone with an
explicit ``checkpoint.resume`` of an abandoned step (which forks again, from there).

Every manifest records its timeline as the forks that led to it, oldest first:
``[["0", null], ["7f3a9c21", 20]]`` is the first timeline up to step 20, then timeline
``7f3a9c21``. A checkpoint is on the current timeline when its own timeline is one of
the current forks and its step is no later than the start of every fork after that one.

The current timeline is ``TIMELINE.json`` at the root, written by rank 0 (under the
lease) when a fork starts, before training: a kill right after a rollback resumes the
rollback's step next time, not the abandoned newest. A root without that file (one that
never forked, or written before timelines) follows the timeline of its newest manifest,
and a manifest without one is on the first timeline: such roots behave as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from skylift.checkpoint.manifest import (
    FIRST_TIMELINE,
    CorruptCheckpointError,
    Manifest,
    committed_steps,
    decode_timeline,
    read_manifest,
    step_folder,
)
from skylift.errors import SkyliftError
from skylift.storage import StorageNotFoundError, Store
from skylift.storage.names import UnsafeNameError

__all__ = [
    "TIMELINE",
    "Forks",
    "Listed",
    "TimelineError",
    "current_timeline",
    "forked",
    "listed",
    "needs_new_timeline",
    "on_timeline",
    "read_recorded",
    "record",
    "resumable_steps",
    "retain",
]

log = logging.getLogger("skylift")

TIMELINE = "TIMELINE.json"
FORMAT = "skylift-timeline/1"
Forks = tuple[tuple[str, int | None], ...]
"""(timeline id, the step of the previous timeline it started from; None for the first), oldest first."""


class TimelineError(SkyliftError):
    """``TIMELINE.json`` does not read."""


@dataclass(frozen=True)
class Listed:
    """A committed checkpoint as its manifest describes it."""

    step: int
    forks: Forks | None
    """Its timeline; None when its manifest is proven corrupt (it never resumes)."""
    created_at: float = 0.0


def listed(store: Store, known: frozenset[int] = frozenset()) -> list[Listed]:
    """Every committed checkpoint of ``store`` but those of steps in ``known``, oldest
    first, with its timeline (one small read per checkpoint).

    Raises:
        StorageError: a manifest could not be read (access denied, an endpoint that does
            not answer): that is no proof the checkpoint is bad.
    """
    found = []
    for step in committed_steps(store):
        if step in known:
            continue
        try:
            manifest = read_manifest(store, step)
        except (CorruptCheckpointError, UnsafeNameError):  # altered or torn: never resumed
            found.append(Listed(step, None))
        else:
            found.append(Listed(step, manifest.timeline, manifest.created_at))
    return found


def on_timeline(step: int, forks: Forks, current: Forks) -> bool:
    """Whether the checkpoint at ``step`` of timeline ``forks`` is on the ``current`` one."""
    identities = [identity for identity, _ in current]
    own = forks[-1][0]
    if own not in identities:
        return False
    return all(step <= start for _, start in current[identities.index(own) + 1:])  # type: ignore[operator]


def resumable_steps(store: Store) -> list[int]:
    """The committed steps auto-resume (or an export of "the newest") may take, oldest
    first: those of the current timeline, and those whose manifest is corrupt (the reader
    skips them, naming them). Resuming itself surveys every node's copies (selection.py).

    Raises:
        StorageError: as :func:`listed` and :func:`read_recorded`.
        TimelineError: as :func:`read_recorded`.
    """
    checkpoints = listed(store)
    current = current_timeline(read_recorded(store), checkpoints)
    return [item.step for item in checkpoints if item.forks is None or on_timeline(item.step, item.forks, current)]


def current_timeline(recorded: Forks | None, checkpoints: Iterable[Listed]) -> Forks:
    """The recorded timeline, else the newest manifest's, else the first."""
    if recorded is not None:
        return recorded
    readable = [item for item in checkpoints if item.forks is not None]
    if not readable:
        return FIRST_TIMELINE
    newest = max(readable, key=lambda item: (item.created_at, item.step))
    assert newest.forks is not None
    return newest.forks


def needs_new_timeline(resumed: Manifest | None, candidates: Iterable[int], current: Forks) -> bool:
    """Whether resuming ``resumed`` (None: starting from step 0) passes over checkpoints
    of the current timeline (``candidates``: its steps, and those whose manifest is
    corrupt), or leaves the current timeline for another."""
    if resumed is None:
        return any(True for _ in candidates)
    if not on_timeline(resumed.step, resumed.timeline, current):
        return True
    return any(step > resumed.step for step in candidates)


def forked(resumed: Manifest | None, identity: str) -> Forks:
    """The timeline that continues from ``resumed`` (None: from step 0) as ``identity``."""
    if resumed is None:
        return ((identity, None),)
    return (*resumed.timeline, (identity, resumed.step))


def read_recorded(store: Store) -> Forks | None:
    """The timeline ``TIMELINE.json`` records, or None if there is none.

    Raises:
        TimelineError: the file does not read as a timeline.
        StorageError: it could not be read.
    """
    try:
        data = store.read_bytes(TIMELINE)
    except StorageNotFoundError:
        return None
    try:
        payload = json.loads(data)
        if payload.get("format") != FORMAT:
            raise ValueError(f"format {payload.get('format')!r} is not {FORMAT!r}")
        return decode_timeline(payload["forks"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise TimelineError(
            f"{store.describe(TIMELINE)} is not a timeline ({error}); skylift writes it whole, so it was altered: "
            "delete it to follow the timeline of the newest checkpoint, or resume a step explicitly "
            "(checkpoint.resume) to start a new one"
        ) from None


def record(store: Store, forks: Forks) -> None:
    """Make ``forks`` the current timeline (one atomic write)."""
    payload = {"format": FORMAT, "forks": [list(fork) for fork in forks]}
    store.write_bytes(TIMELINE, json.dumps(payload, indent=1).encode())


def retain(store: Store, keep: int, current: Forks) -> list[int]:
    """Keep the newest ``keep`` checkpoints of the current timeline; delete the rest
    (older ones, abandoned timelines' and those whose manifest is corrupt). Returns the
    steps deleted.

    The checkpoints kept were verified: after a resume no checkpoint of the current
    timeline is newer than the one resumed (read and verified) save those this run
    committed (hashed as written). A timeline with no checkpoint here deletes nothing.
    """
    checkpoints = listed(store)
    live = [item.step for item in checkpoints
            if item.forks is not None and on_timeline(item.step, item.forks, current)]  # fmt: skip
    if not live:
        return []
    kept = set(live[-keep:])
    removed = [item.step for item in checkpoints if item.step not in kept]
    for step in removed:
        if step not in live:
            log.warning("removing checkpoint %s: it is not on the current timeline (abandoned by a rollback, a "
                        "fresh start or a corrupt manifest)", store.describe(step_folder(step)))
        store.delete_prefix(step_folder(step))
    return removed

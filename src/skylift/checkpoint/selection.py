"""Which checkpoint a resume restores, agreed by all ranks.

``checkpoint.resume`` chooses: ``auto`` (the newest of the current timeline that reads
and verifies), ``never`` (refused if the root holds checkpoints) or a ``step-N`` folder.
``auto`` skips a checkpoint only when it is proven incomplete or corrupt (a file the
manifest lists is missing, a hash does not match, the manifest does not decode). One
that cannot be read (access denied, no bucket, rejected credentials, an endpoint that
stopped answering) stops the resume on every rank, naming the cause: passing over it
would quietly go back to an older step, or start over.

A resume that passes over newer checkpoints starts a new timeline (timeline.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skylift.checkpoint.manifest import (
    FIRST_TIMELINE,
    LATEST,
    CorruptCheckpointError,
    Manifest,
    read_manifest,
    read_verified,
    step_folder,
)
from skylift.checkpoint.state import (
    DCP_METADATA_FILE,
    EXTRA_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    SHARDED,
    TRAINER_FILE,
    rng_files,
)
from skylift.checkpoint.tiers import LocalTier, manifest_with_fallback, read_with_fallback
from skylift.checkpoint.timeline import (
    Forks,
    TimelineError,
    current_timeline,
    forked,
    listed,
    needs_new_timeline,
    on_timeline,
    read_recorded,
    record,
)
from skylift.errors import SkyliftConfigError
from skylift.loop.distributed import DistributedContext
from skylift.storage import StorageError, Store
from skylift.storage.names import UnsafeNameError

__all__ = ["ResumeSelection"]

log = logging.getLogger("skylift")


class ResumeSelection:
    """The checkpoints one resume may restore, and the timeline its saves continue.

    Args:
        choice: ``checkpoint.resume``.
        store: the checkpoint root; ``tier``: this node's local copies, or None.
        gather_all, broadcast: the session's collectives on its control group (each
            value from every rank; rank 0's value to every rank).
    """

    def __init__(
        self,
        choice: str,
        store: Store,
        tier: LocalTier | None,
        context: DistributedContext,
        gather_all: Callable[[Any], list[Any]],
        broadcast: Callable[[Any], Any],
    ) -> None:
        self.choice = choice
        self.store, self.tier, self.context = store, tier, context
        self._gather_all, self._broadcast = gather_all, broadcast
        self.timeline: Forks = FIRST_TIMELINE
        """The current timeline (set by :meth:`checkpoints`)."""
        self.candidates: list[int] = []
        """Steps ``auto`` may try, newest first: the current timeline's, in the root or any
        node's local copy, and those whose manifest is corrupt (skipped with a warning)."""
        self.existing: list[int] = []
        """Every committed step, on any timeline."""
        self.resumed_from = ""
        """With a local tier: how many files came from it."""

    def checkpoints(self) -> Iterator[tuple[int, Manifest, dict[str, bytes]]]:
        """The checkpoints ``checkpoint.resume`` selects, newest first, each with its
        manifest and this rank's files of it (read and verified)."""
        self._survey()
        if self.choice == "never":
            self._refuse_existing()
            return
        if self.choice != "auto":
            step = self._broadcast(self._explicit(self.choice) if self.context.is_main else None)
            manifest = read_manifest(self.store, step)  # raises CorruptCheckpointError: no fallback
            yield step, manifest, read_verified(self.store, step, manifest, self.names_for_this_rank(manifest))
            return
        for step in self.candidates:
            manifest, contents, problem, unreadable = self._try_read(step)
            problems = self._gather_all((problem, unreadable is not None))
            if unreadable is not None:
                raise _stopped_by(self.store.describe(step_folder(step)), unreadable)
            if any(fatal for _, fatal in problems):
                where = self.store.describe(step_folder(step))
                raise StorageError(f"cannot resume: another rank could not read {where}; its error names the cause")
            if not any(problem for problem, _ in problems):
                yield step, manifest, contents
                continue
            for rank, (rank_problem, _) in enumerate(problems):
                if rank_problem and (rank == self.context.rank or self.context.is_main):
                    log.warning("skipping checkpoint %s: %s", self.store.describe(step_folder(step)), rank_problem)

    def continue_timeline(self, resumed: Manifest | None) -> Forks:
        """The timeline this run's checkpoints belong to (collective): the current one, or
        a new one when this resume (``resumed``; None: from step 0) passes over newer
        checkpoints. A new one is recorded at the root before training, so that a kill
        before the run's first commit cannot bring the abandoned steps back."""
        if not needs_new_timeline(resumed, self.candidates, self.timeline):
            return self.timeline
        forks = self._broadcast(forked(resumed, uuid.uuid4().hex[:8]) if self.context.is_main else None)
        error = None
        if self.context.is_main:
            try:
                record(self.store, forks)
                # LATEST names the newest checkpoint of the current timeline, for tools.
                if resumed is not None:
                    self.store.write_bytes(LATEST, f"{step_folder(resumed.step)}\n".encode())
                else:
                    self.store.delete([LATEST])
            except StorageError as failure:
                error = failure
        problem = self._broadcast(None if error is None else str(error))
        if error is not None:
            raise error
        if problem:
            raise StorageError(f"cannot start a new timeline: rank 0: {problem}")
        passed = [step for step in self.candidates if resumed is None or step > resumed.step]
        if resumed is None:
            log.error("no checkpoint under %s could be restored (steps %s: see the warnings above); starting from "
                      "step 0 on a new timeline, and they are removed at its first commit", self.store.url, passed)
        elif self.context.is_main:
            log.warning("resuming step %d passes over steps %s: they are abandoned (auto-resume will not return to "
                        "them) and removed at this run's first commit", resumed.step, passed)
        return forks

    def names_for_this_rank(self, manifest: Manifest) -> list[str]:
        """The files read before the load: a sharded checkpoint's shards are read during it."""
        if manifest.layout == SHARDED:
            names = [DCP_METADATA_FILE, OPTIMIZER_FILE, TRAINER_FILE]
        else:
            names = [MODEL_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_FILE, TRAINER_FILE]
        return names + [name for name in (*rng_files(self.context.rank), EXTRA_FILE) if name in manifest.files]

    def _survey(self) -> None:
        """Every rank learns the current timeline, the candidates and the existing steps."""
        found, recorded, error = [], None, None
        try:
            if self.tier is not None and self.tier.node_leader:
                found += listed(self.tier.store)
        except (StorageError, TimelineError) as failure:
            error = failure
        # A step some node holds locally has the same timeline in its manifest there: the
        # root's copy of that manifest is not read (a resume from memory reads nothing).
        held = frozenset(item.step for report in self._gather_all(found) for item in report
                         if item.forks is not None) if self.tier is not None else frozenset()  # fmt: skip
        try:
            if self.context.is_main and error is None:
                found += listed(self.store, known=held)
                recorded = read_recorded(self.store)
        except (StorageError, TimelineError) as failure:
            error = failure
        reports = self._gather_all((found, recorded, None if error is None else str(error)))
        if isinstance(error, StorageError):
            raise _stopped_by(f"the checkpoints under {self.store.url}", error)
        if error is not None:
            raise error
        if any(report[2] for report in reports):
            raise StorageError("cannot resume: " + "; ".join(report[2] for report in reports if report[2]))
        checkpoints = [item for report in reports for item in report[0]]
        self.timeline = current_timeline(reports[0][1], checkpoints)
        self.existing = sorted({item.step for item in checkpoints})
        self.candidates = sorted(
            {item.step for item in checkpoints
             if item.forks is None or on_timeline(item.step, item.forks, self.timeline)},
            reverse=True,
        )  # fmt: skip
        abandoned = sorted(set(self.existing) - set(self.candidates))
        if abandoned and self.context.is_main and self.choice == "auto":
            log.info("not resuming steps %s: they belong to a timeline abandoned by a rollback or a fresh start",
                     abandoned)

    def _try_read(self, step: int) -> tuple[Any, Any, str | None, StorageError | None]:
        """(manifest, this rank's files, None, None); (None, None, the problem, None) when
        the checkpoint is proven incomplete or corrupt; (None, None, None, the error) when
        it could not be read."""
        local = self.tier.store if self.tier is not None else None
        try:
            manifest = manifest_with_fallback(step, local, self.store)
            if not on_timeline(step, manifest.timeline, self.timeline):  # the copy read is another timeline's
                return None, None, "its manifest here is of an abandoned timeline", None
            contents, sources = read_with_fallback(manifest, self.names_for_this_rank(manifest), local, self.store)
        except (CorruptCheckpointError, UnsafeNameError) as error:
            return None, None, str(error), None
        except StorageError as error:
            return None, None, None, error
        if self.tier is not None and local is not None:
            from_local = sum(source == "local" for source in sources.values())
            self.resumed_from = f": {from_local} of {len(sources)} files from the {self.tier.copy_name} {local.url}"
        return manifest, contents, None, None

    def _refuse_existing(self) -> None:
        if self.existing:
            where = self.store.url + (f" or {self.tier.store.url}" if self.tier is not None else "")
            raise SkyliftConfigError(
                f"checkpoint.resume is 'never' but {where} already holds checkpoints "
                f"(steps {self.existing}); use --resume auto, or a new checkpoint.root"
            )

    def _explicit(self, location: str) -> int:
        parent, _, name = location.rstrip("/").rpartition("/")
        if not name.startswith("step-") or not name[5:].isdigit():
            raise SkyliftConfigError(f"checkpoint.resume: {location!r} is not a step-N checkpoint folder")
        if parent.rstrip("/") != self.store.url.rstrip("/") and Path(parent).absolute() != Path(self.store.url):
            raise SkyliftConfigError(
                f"checkpoint.resume: {location!r} is not under checkpoint.root {self.store.url!r}; "
                "set checkpoint.root to its parent"
            )
        return int(name[5:])


def _stopped_by(what: str, error: StorageError) -> StorageError:
    """The error that stops a resume, of ``error``'s class (permanent or transient)."""
    message = (
        f"cannot resume: {what} could not be read, so no checkpoint was skipped and the run did not start over "
        f"(only a checkpoint proven incomplete or corrupt is skipped): {error}. Fix the access to checkpoint.root "
        "and run again"
    )
    try:
        return type(error)(message)
    except TypeError:  # an error class with arguments of its own
        return StorageError(message)

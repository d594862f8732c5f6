"""Write checkpoints (in the background) and commit them collectively.

Commit protocol, per save at step N:

1. Every rank copies its share of the state off the device (the only stall the
   training step pays when ``async_save`` is on).
2. In the background, every rank serialises and writes its files into ``step-N/``.
3. The ranks exchange (ok, file sizes and hashes) on a dedicated gloo group.
4. Only if every rank succeeded, rank 0 writes ``manifest.json`` (the commit point),
   then ``LATEST``, then keeps the newest ``keep`` checkpoints of the current timeline
   (timeline.py) and deletes the rest. Otherwise it removes ``step-N/`` and every rank
   learns that the save was abandoned.

A crash anywhere before step 4 leaves a folder without a manifest, which readers
ignore and the next start deletes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from skylift.checkpoint.faults import fault_point
from skylift.checkpoint.manifest import (
    FIRST_TIMELINE,
    LATEST,
    MANIFEST,
    Manifest,
    hashing,
    step_folder,
    uncommitted_steps,
)
from skylift.checkpoint.memory_tier import SAFE_MARKER
from skylift.checkpoint.state import Snapshot
from skylift.checkpoint.tiers import LocalTier
from skylift.checkpoint.timeline import Forks, retain
from skylift.loop.collectives import collective
from skylift.storage import Store
from skylift.storage.base import Chunks

__all__ = ["CheckpointManager", "SaveResult"]

log = logging.getLogger("skylift")


class SaveCancelled(Exception):
    """A background save given up so that a newer emergency save can start at once."""


class SaveResult:
    """What happened to one save (filled in when it finishes)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.committed = False
        self.error: str | None = None
        self.stall_s = 0.0
        self.write_s = 0.0
        self.finished = False
        self.local_commit_s: float | None = None
        """With a local tier: seconds from the save's start to its local commit."""
        self.local_committed_at: float | None = None
        """With a local tier: Unix time of the local commit."""
        self.uploaded: bool | None = None
        """With a local tier: whether the root's copy committed too (None: no tier)."""
        self.upload_error: str | None = None
        self.safe: bool | None = None
        """With a replicated memory tier: whether every node's share reached its peer's memory."""
        self.safe_s: float | None = None
        """Seconds from the save's start to *safe* (None: not safe)."""
        self.safe_at: float | None = None
        self.safe_error: str | None = None


class CheckpointManager:
    """Saves snapshots to ``store`` and keeps the newest ``keep`` committed ones of the
    current timeline (:attr:`timeline`).

    Args:
        store: the checkpoint root.
        rank, world_size: this process's place in the job.
        keep: committed checkpoints to keep (>= 2, so a bad newest one never leaves none).
        async_save: write in a background thread.
        group: a gloo process group reserved for checkpoint commits (distributed only).
        on_commit_failure: called (in the writer thread) with the error when a save is abandoned.
        tier: a node-local copy committed first, then uploaded to ``store`` (see tiers.py).
    """

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        keep: int,
        async_save: bool,
        group: Any = None,
        on_commit_failure: Callable[[str], None] | None = None,
        tier: LocalTier | None = None,
    ) -> None:
        if keep < 2:
            raise ValueError(f"checkpoint.keep must be >= 2, got {keep}")
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.keep = keep
        self._group = group
        self._on_failure = on_commit_failure
        self.tier = tier
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="skylift-checkpoint") if async_save else None
        self._in_flight: Future[SaveResult] | None = None
        self._copying: Snapshot | None = None
        self._cancel = threading.Event()
        self.history: list[SaveResult] = []
        self.timeline: Forks = FIRST_TIMELINE
        """The timeline every manifest records and retention keeps (the session sets it at resume)."""
        self.run_config: dict[str, Any] | None = None
        """The run's configuration every manifest records (see compatibility.py), or None."""

    @property
    def group(self) -> Any:
        """The gloo group of the commits (None in one process). A sharded save's and
        restore's planning runs on it too, on the training thread: never while a save is
        in flight (:meth:`save` waits for the previous one first)."""
        return self._group

    @property
    def busy(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    @property
    def last_committed(self) -> SaveResult | None:
        return next((result for result in reversed(self.history) if result.committed), None)

    def remove_uncommitted(self) -> list[int]:
        """Delete ``step-N/`` folders without a manifest (rank 0, at start, under the lease)."""
        abandoned = uncommitted_steps(self.store)
        for step in abandoned:
            log.warning("removing abandoned partial checkpoint %s", self.store.describe(step_folder(step)))
            self.store.delete_prefix(step_folder(step))
        return abandoned

    def save(self, capture: Callable[[], Snapshot], step: int, *, blocking: bool = False) -> SaveResult:
        """Capture now; write and commit in the background unless ``blocking``.

        Every rank must call this at the same step. A save still in flight is
        finished first, so saves commit in order and never overlap.
        """
        self.wait()
        self._cancel.clear()
        result = SaveResult(step)
        started = time.perf_counter()
        snapshot = capture()
        result.stall_s = time.perf_counter() - started
        self.history.append(result)
        if self._executor is None or blocking:
            snapshot.complete_copies()
            result.stall_s = time.perf_counter() - started
            self._write_and_commit(snapshot, result)
        else:
            self._copying = snapshot
            self._in_flight = self._executor.submit(self._write_and_commit, snapshot, result)
        return result

    def wait_for_copies(self) -> float:
        """Block until the save in flight has copied the state it defers; return the
        seconds waited (call before anything changes parameters or optimizer state)."""
        snapshot = self._copying
        if snapshot is None or snapshot.copied.is_set():
            return 0.0
        started = time.perf_counter()
        snapshot.copied.wait()
        waited = time.perf_counter() - started
        if self.history:
            self.history[-1].stall_s += waited
        return waited

    def cancel_in_flight(self) -> None:
        """Abandon the save in flight at its next chunk: it will not commit (with a local
        tier, a save already committed locally keeps that copy and stops its upload)."""
        if self.busy:
            self._cancel.set()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or abandoned."""
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None
            self._copying = None

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _write_and_commit(self, snapshot: Snapshot, result: SaveResult) -> SaveResult:
        started = time.perf_counter()
        first = self.tier.store if self.tier is not None else self.store
        entries, error = self._write_files(snapshot, first)
        result.committed, result.error, manifest = self._commit(snapshot.step, entries, error, first,
                                                                snapshot.layout, snapshot.local_entries)
        if result.committed and self.tier is not None:
            result.local_commit_s = time.perf_counter() - started
            result.local_committed_at = time.time()
            if self.tier.replicates:
                self._replicate(snapshot.step, manifest, result, started)
            self._upload(snapshot.step, entries, result, snapshot.layout)
        result.write_s = time.perf_counter() - started
        result.finished = True
        if result.committed:
            log.info("checkpoint step %d committed (%.2f s)", snapshot.step, result.write_s)
        else:
            log.error("checkpoint step %d abandoned, previous commit kept: %s", snapshot.step, result.error)
            if self._on_failure is not None:
                self._on_failure(result.error or "unknown error")
        return result

    def _write_files(self, snapshot: Snapshot, store: Store) -> tuple[dict[str, dict[str, Any]], str | None]:
        """This rank's files of the snapshot into ``store``: (name -> size and sha256, error)."""
        entries: dict[str, dict[str, Any]] = {}
        folder = step_folder(snapshot.step)
        try:
            snapshot.complete_copies()
            local_copy = self.tier is not None and store is self.tier.store
            for name, make_chunks in snapshot.files():
                if name in snapshot.local_only and not local_copy:
                    continue
                self._raise_if_cancelled()
                hashed, entry = hashing(self._cancellable(make_chunks))
                store.write_chunks(f"{folder}/{name}", hashed)
                if name in snapshot.local_only:  # rank 0 reports (and uploads) these
                    snapshot.local_entries[name] = entry
                else:
                    entries[name] = entry
                fault_point("during_payload", step=snapshot.step, rank=self.rank)
            fault_point("after_payload", step=snapshot.step, rank=self.rank)
            self._raise_if_cancelled()
        except Exception as failure:  # noqa: BLE001 - any failure abandons this save on every rank
            return entries, f"rank {self.rank}: {type(failure).__name__}: {failure}"
        return entries, None

    def _upload(self, step: int, entries: dict[str, dict[str, Any]], result: SaveResult, layout: str) -> None:
        """Second commit, from the local copy to the root; the local commit stands either way."""
        assert self.tier is not None
        error = None
        try:
            # An emergency save cancels this upload too: its step stays committed on
            # the local disk, and the newer step goes first.
            self.tier.upload(step, entries, wrap=self._cancellable)
            fault_point("after_upload", step=step, rank=self.rank)
        except Exception as failure:  # noqa: BLE001 - any failure abandons the upload on every rank
            error = f"rank {self.rank}: upload: {type(failure).__name__}: {failure}"
        result.uploaded, result.upload_error, _ = self._commit(step, entries, error, self.store, layout)
        if not result.uploaded:
            log.error("checkpoint step %d kept only on this node's disk: %s", step, result.upload_error)

    def _replicate(self, step: int, manifest: bytes | None, result: SaveResult, started: float) -> None:
        """Node leaders send their node's files to the next node's memory; every rank then
        learns whether the step is *safe* (in two nodes' memory everywhere). Not safe is
        no failure of the save: it stays committed locally and is uploaded as ever."""
        tier = self.tier
        assert tier is not None and manifest is not None
        error = None
        if tier.node_leader:
            try:
                tier.replicate(step, manifest, check=self._raise_if_cancelled, rank=self.rank)
            except Exception as failure:  # noqa: BLE001 - reported to every rank; the save itself stands
                error = f"node {getattr(tier, 'node_rank', 0)}: {type(failure).__name__}: {failure}"
        errors = [report[1] for report in self._gather(({}, error), "the replica reports (all_gather)") if report[1]]
        result.safe = not errors
        if errors:
            result.safe_error = "; ".join(errors)
            log.warning("checkpoint step %d is not safe (in one node's memory only): %s", step, result.safe_error)
            return
        result.safe_s, result.safe_at = time.perf_counter() - started, time.time()
        if self.rank == 0:
            try:  # for a resume that finds this step nowhere: it says which one it passed over
                self.store.write_bytes(SAFE_MARKER, f"{step_folder(step)}\n".encode())
            except Exception as failure:  # noqa: BLE001 - a marker only; the upload reports a store that is down
                log.warning("could not record step %d as safe at the root: %s", step, failure)

    def _cancellable(self, make_chunks: Chunks) -> Chunks:
        """Chunks that stop at a cancel: an emergency save must not first wait for the
        rest of a large file of the older save (an aborted upload leaves nothing)."""

        def chunks() -> Iterator[bytes | memoryview]:
            for chunk in make_chunks():
                self._raise_if_cancelled()
                yield chunk

        return chunks

    def _raise_if_cancelled(self) -> None:
        if self._cancel.is_set():
            raise SaveCancelled("cancelled for an emergency save of a newer step")

    def _commit(
        self,
        step: int,
        entries: dict[str, dict[str, Any]],
        error: str | None,
        store: Store,
        layout: str,
        local_entries: dict[str, dict[str, Any]] | None = None,
    ) -> tuple[bool, str | None, bytes | None]:
        """All ranks report; rank 0 writes ``store``'s manifest if every rank succeeded.
        Returns (committed, the error, the manifest's bytes)."""
        reports = self._gather((entries, error))
        decision: list[Any] = [False, None, None]
        if self.rank == 0:
            errors = [report[1] for report in reports if report[1]]
            if errors:
                decision = [False, "; ".join(errors), None]
            else:
                decision = self._write_manifest(step, reports, store, layout)
            if not decision[0]:
                self._discard(step, store)
        if self.world_size > 1:
            with collective("the checkpoint commit decision (broadcast from rank 0)"):
                dist.broadcast_object_list(decision, src=0, group=self._group)
        tier = self.tier
        if tier is not None and store is tier.store and self.rank != 0 and tier.node_leader:
            # Other nodes' local copies: their ranks' files are in place, so commit them too.
            if decision[0] and decision[2] is not None:
                tier.write_manifest(step, decision[2])
                tier.drop_mismatches(step, decision[2], local_entries or {})
                retain(tier.store, tier.keep or self.keep, self.timeline)
            elif not decision[0]:
                tier.discard(step)
        return bool(decision[0]), decision[1], decision[2]

    def _write_manifest(
        self, step: int, reports: list[tuple[dict, str | None]], store: Store, layout: str
    ) -> list[Any]:
        files: dict[str, dict[str, Any]] = {}
        for report_entries, _ in reports:
            files.update(report_entries)
        encoded = Manifest.create(step, self.world_size, files, layout, self.timeline, self.run_config).encode()
        written = False  # the manifest's write returned: committed, whatever fails after it
        try:
            store.write_bytes(f"{step_folder(step)}/{MANIFEST}", encoded)
            written = True
            fault_point("after_manifest", step=step, rank=self.rank)
            store.write_bytes(LATEST, f"{step_folder(step)}\n".encode())
            tier_keep = self.tier.keep if self.tier is not None and store is self.tier.store else None
            retain(store, tier_keep or self.keep, self.timeline)
        except Exception as failure:  # noqa: BLE001 - reported to every rank, which then agree on the outcome
            if written or _exists_or_false(store, f"{step_folder(step)}/{MANIFEST}"):
                # Committed; only LATEST or retention failed, which the next save repairs.
                log.warning("checkpoint step %d committed, but bookkeeping failed: %s", step, failure)
                return [True, None, encoded]
            return [False, f"rank 0: manifest: {type(failure).__name__}: {failure}", None]
        return [True, None, encoded]

    def _discard(self, step: int, store: Store) -> None:
        try:
            store.delete_prefix(step_folder(step))
        except Exception as failure:  # noqa: BLE001 - the next start removes it; never mask the save error
            log.warning("could not remove abandoned %s: %s", store.describe(step_folder(step)), failure)

    def _gather(self, report: tuple[dict, str | None],
                name: str = "the checkpoint write reports (all_gather)") -> list[tuple[dict, str | None]]:
        if self.world_size == 1:
            return [report]
        reports: list[Any] = [None] * self.world_size
        with collective(name):
            dist.all_gather_object(reports, report, group=self._group)
        return reports


def _exists_or_false(store: Store, key: str) -> bool:
    """Whether a write that raised landed anyway; False when the store cannot say (it is
    down): a store failing here must not crash the writer thread (the save is abandoned)."""
    try:
        return store.exists(key)
    except Exception:  # noqa: BLE001 - the writer thread must outlive a failing store (see above)
        return False

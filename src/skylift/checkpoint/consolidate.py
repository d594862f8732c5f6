"""A checkpoint's model as full, unsharded tensors, in one process without a process group.

Either layout: a replicated checkpoint's ``model.safetensors`` (one process, DDP) or a
sharded one's chunks (FSDP2, any number of ranks), assembled by DCP's planner. Every
file read is checked against the manifest first; nothing is unpickled; the optimizer
state is never read. "The newest" is the one auto-resume would take: the newest of the
current timeline (a rollback's abandoned steps are never exported), skipping only those
proven incomplete or corrupt; one that cannot be read (access denied, an endpoint that
stopped answering) stops the export naming the cause. This is what ``skylift export``
builds on::

    from skylift.checkpoint.consolidate import full_model_state

    step, weights = full_model_state("runs/llama/checkpoints")  # or s3://bucket/run, oss://, cos://
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights)  # the module's own parameter and buffer names
    model.save_pretrained(out_dir)   # safetensors
"""

from __future__ import annotations

import logging

import torch
from safetensors.torch import load as load_tensors

from skylift.checkpoint.manifest import (
    CorruptCheckpointError,
    Manifest,
    read_manifest,
    read_verified,
    step_folder,
    verified_file,
)
from skylift.checkpoint.sharded import decode_metadata, load_full
from skylift.checkpoint.state import DCP_METADATA_FILE, MODEL_FILE, SHARDED
from skylift.checkpoint.timeline import resumable_steps
from skylift.storage import StorageError, Store, open_store
from skylift.storage.names import UnsafeNameError

__all__ = ["full_model_state", "newest_resumable_step"]

log = logging.getLogger("skylift")


def full_model_state(
    root: str | Store, *, step: int | None = None, endpoint_url: str | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """The newest complete checkpoint's step and its model's full state dict.

    Args:
        root: the checkpoint root, ``checkpoint.root`` (by default ``RUN_DIR/checkpoints``):
            a folder or an ``s3://``, ``oss://``, ``cos://`` URL (or a store opened on one).
        step: this committed step instead of the newest; no fallback if it does not verify.
        endpoint_url: the object store's endpoint, as ``checkpoint.endpoint_url``.

    Returns:
        ``(step, state)``: ``state`` maps each parameter and buffer name (the module's own,
        without DDP's or ``torch.compile``'s prefixes) to a plain, contiguous CPU tensor of
        the saved dtype, unsharded.

    Raises:
        CorruptCheckpointError: no committed checkpoint of the current timeline verifies
            (newest first: a torn or corrupt one is skipped with a warning naming it), or
            ``step`` does not.
        StorageError: a checkpoint could not be read (the class says whether retrying may
            help): no older one is taken instead.
        TimelineError: the root's ``TIMELINE.json`` does not read.
    """
    store = root if isinstance(root, Store) else open_store(root, endpoint_url=endpoint_url)
    if step is not None:
        return step, _model_state(store, read_manifest(store, step))
    for candidate in reversed(_candidates(store)):
        try:
            return candidate, _model_state(store, read_manifest(store, candidate))
        except (CorruptCheckpointError, UnsafeNameError) as problem:  # proven bad: the next older one
            log.warning("skipping checkpoint %s: %s", store.describe(step_folder(candidate)), problem)
        except StorageError as error:
            raise _stopped_by(store.describe(step_folder(candidate)), error) from error
    raise CorruptCheckpointError(f"{store.url} holds no complete checkpoint (none committed, or none verifies)")


def newest_resumable_step(store: Store) -> int | None:
    """The newest committed step of the current timeline (listed, not yet verified), or None.

    Raises:
        StorageError, TimelineError: as :func:`full_model_state`.
    """
    steps = _candidates(store)
    return steps[-1] if steps else None


def _candidates(store: Store) -> list[int]:
    try:
        return resumable_steps(store)
    except StorageError as error:
        raise _stopped_by(f"the checkpoints under {store.url}", error) from error


def _stopped_by(what: str, error: StorageError) -> StorageError:
    """The error that stops an export, of ``error``'s class (permanent or transient)."""
    message = (
        f"cannot export: {what} could not be read, so no older checkpoint was taken instead (only a checkpoint "
        f"proven incomplete or corrupt is skipped): {error}. Fix the access to checkpoint.root and run again"
    )
    try:
        return type(error)(message)
    except TypeError:  # an error class with arguments of its own
        return StorageError(message)


def _model_state(store: Store, manifest: Manifest) -> dict[str, torch.Tensor]:
    folder = step_folder(manifest.step)
    if manifest.layout != SHARDED:
        return load_tensors(read_verified(store, manifest.step, manifest, [MODEL_FILE])[MODEL_FILE])
    document = read_verified(store, manifest.step, manifest, [DCP_METADATA_FILE])[DCP_METADATA_FILE]
    metadata = decode_metadata(document, store.describe(f"{folder}/{DCP_METADATA_FILE}"))

    def read(name: str) -> bytes:
        entry = manifest.files.get(name)
        if entry is None:
            raise CorruptCheckpointError(f"{store.describe(f'{folder}/{name}')} is not listed in the manifest")
        return verified_file(store, f"{folder}/{name}", entry)

    return load_full(metadata, read)

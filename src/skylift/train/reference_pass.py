"""DPO's reference log-probabilities, computed before the first step or read where a
run stored them (``recipe.dpo.precompute_reference``; the table is
:mod:`skylift.recipes.reference_table`'s).

The pass runs after the model is placed (sharded under FSDP) and before the checkpoint
loads, so the model it reads is the model as built, the starting model, on a fresh run
and on a resume alike: a resume that finds no stored table (another root, a table of
another fingerprint) computes the same values again instead of refusing. The pass
reads every training and validation pair once, in evaluation batches, each rank its
share (FSDP's ranks in lockstep, as in evaluation); the ranks then exchange their parts,
and rank 0 stores the whole table at ``checkpoint.root``/``reference/`` (written
atomically, under the run's lease), where the next attempt of the run reads it whatever
its rank count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from skylift.data.datasets import DatasetSplit
from skylift.data.sampler import ShardedEvalSampler
from skylift.loop.collectives import collective
from skylift.recipes.reference_table import ReferenceTable
from skylift.storage import StorageError, Store

__all__ = ["REFERENCE_FOLDER", "prepare_reference_table"]

log = logging.getLogger("skylift")

REFERENCE_FOLDER = "reference"
"""Under ``checkpoint.root``: one table per fingerprint, ``<fingerprint>.safetensors``."""


def prepare_reference_table(recipe: Any, model: nn.Module, data: DatasetSplit, runtime: Any, *,
                            batch_size: int, stores: tuple[Store, Store] | None) -> None:
    """Give ``recipe`` its table of reference log-probabilities, if it asks for one
    (``recipe.reference_fingerprint``): read from ``stores`` (the checkpoint root to read,
    the lease-fenced one to write; None: checkpoints off) or computed with ``model``."""
    fingerprint_of = getattr(recipe, "reference_fingerprint", None)
    fingerprint = fingerprint_of(runtime.precision.name) if fingerprint_of is not None else None
    if fingerprint is None:
        return
    key = f"{REFERENCE_FOLDER}/{fingerprint}.safetensors"
    table = _stored(stores[0], key, fingerprint) if stores is not None else None
    if table is not None and stores is not None:
        log.info("DPO: the reference log-probabilities of %d distinct pairs read from %s", len(table),
                 stores[0].describe(key))
        recipe.use_reference_table(table)
        return
    started = time.perf_counter()
    table = _computed(recipe, model, data, runtime, batch_size, fingerprint)
    where = "not stored: checkpoints are off"
    if stores is not None:
        where = f"stored at {stores[1].describe(key)}"
        if runtime.dist.is_main:
            stores[1].write_bytes(key, table.to_bytes())
    log.info("DPO: the reference log-probabilities of %d distinct pairs computed in %.2f s with the starting "
             "model (%s)", len(table), time.perf_counter() - started, where)
    recipe.use_reference_table(table)


def _stored(store: Store, key: str, fingerprint: str) -> ReferenceTable | None:
    """The table at ``key``, or None where there is none (a table that does not parse is
    computed again, with a warning; the root unreachable stops the run, as a resume does)."""
    try:
        if not store.exists(key):
            return None
        data = store.read_bytes(key)
    except StorageError as error:
        raise StorageError(f"cannot read the precomputed reference log-probabilities {store.describe(key)}: "
                           f"{error}") from error
    try:
        return ReferenceTable.from_bytes(data, fingerprint)
    except (ValueError, KeyError) as error:  # safetensors' parse errors are ValueErrors
        log.warning("the stored reference table %s does not read (%s): computing it again", store.describe(key), error)
        return None


@torch.no_grad()
def _computed(recipe: Any, model: nn.Module, data: DatasetSplit, runtime: Any, batch_size: int,
              fingerprint: str) -> ReferenceTable:
    module = runtime.unwrap(model)  # under FSDP the sharded module: every forward a collective
    was_training = module.training
    module.eval()  # the reference scores without dropout, as a frozen copy would
    table = ReferenceTable(fingerprint)
    try:
        for loader in _pair_loaders(recipe, data, runtime.dist, batch_size):
            for host_batch, counted in runtime.evaluation_batches(loader):
                batch = runtime.to_device(host_batch)
                with runtime.precision.autocast(runtime.device.type):
                    keys, chosen, rejected = recipe.reference_log_probs(module, batch)
                if counted:
                    table.add(keys, chosen.float(), rejected.float())
    finally:
        module.train(was_training)
    if runtime.dist.is_distributed:
        parts: list[Any] = [None] * runtime.dist.world_size
        with collective("the precomputed reference log-probabilities (all_gather_object)"):
            dist.all_gather_object(parts, table.values)
        for part in parts:
            table.values.update(part)
    return table


def _pair_loaders(recipe: Any, data: DatasetSplit, context: Any, batch_size: int) -> Iterable[Any]:
    """This rank's share of the training pairs, then of the validation pairs, in batches
    of ``batch_size`` pairs, read in this process."""
    from skylift.data.table_stream import TableEval, TableStream

    for split in (data.train, data.val):
        if split is None:
            continue
        pairs = split
        if isinstance(split, TableStream):  # rows streamed from a table source: every row once
            pairs = TableEval(split.source, split.units, decode=split.decode, collate=split.collate,
                              batch_size=batch_size)  # fmt: skip
        if isinstance(pairs, TableEval):
            pairs.place(context.rank, context.world_size)
            yield pairs
            continue
        shards = ShardedEvalSampler(len(cast(Any, pairs)), batch_size, rank=context.rank,
                                    world_size=context.world_size)  # fmt: skip
        yield DataLoader(pairs, batch_sampler=shards, collate_fn=recipe.collate(False), num_workers=0)

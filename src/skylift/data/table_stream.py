"""Train on a table source's rows as they are fetched, in the tar shards' order.

:class:`TableStream` is a :class:`~skylift.data.streaming.StreamingDataset` whose shards
are the source's row groups (:mod:`skylift.data.table_rows`): the same seeded order
(row groups permuted, rows shuffled inside blocks of ``shuffle_block_shards`` row
groups, cut into global batches that do not depend on the number of ranks or workers),
the same state (epoch, start step, seed), so a resume at global step ``s`` skips the
first ``s`` global batches exactly, on any world size whose slices divide the global
batch. Row groups are fetched as the order first needs them, ``prefetch_shards`` ahead
by a background thread, and held in memory for the current shuffle block; nothing is
downloaded before it is needed.

:class:`TableEval` scores every row once, each rank a contiguous range of rows.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from skylift.data.shards import ShardIndex, ShardInfo
from skylift.data.streaming import StreamingDataset, _ShardReader
from skylift.data.table_rows import TableSource, TableUnit
from skylift.errors import SkyliftConfigError

__all__ = ["TableEval", "TableStream"]

Decode = Callable[[Any], Any]


class TableStream(StreamingDataset):
    """This rank's micro-batches of ``units`` (rows decoded by ``decode``, batched by
    ``collate``); use with ``DataLoader(batch_size=None)`` after :meth:`place`.

    Raises:
        SkyliftConfigError: the units hold fewer rows than one global batch.
    """

    def __init__(self, source: TableSource, units: list[TableUnit], *, decode: Decode,
                 collate: Callable[[list[Any]], Any], global_batch_size: int, accumulation_steps: int, seed: int,
                 prefetch_shards: int, shuffle_block_shards: int, shuffle: bool = True) -> None:  # fmt: skip
        self.source, self.units = source, units
        index = ShardIndex([ShardInfo(unit.name, unit.num_rows, unit.size, "") for unit in units], list(source.columns))
        self._set_order(index, global_batch_size=global_batch_size, accumulation_steps=accumulation_steps, seed=seed,
                        shuffle=shuffle, shuffle_block_shards=shuffle_block_shards)  # fmt: skip
        if index.num_samples < global_batch_size:
            raise SkyliftConfigError(f"{source.field}: {index.num_samples} training rows are fewer than one global "
                                     f"batch (data.global_batch_size: {global_batch_size})",
                                     hint="Lower data.global_batch_size or give more rows")  # fmt: skip
        self.decode, self.collate = decode, collate
        self.prefetch_shards = prefetch_shards
        self.fetched: list[str] = []
        """Units this process fetched, in order (what a test of on-demand reading reads)."""

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        mine = self.micro_batches()[worker_id::num_workers]
        reader = _UnitReader(self, mine)
        try:
            for batch in mine:
                yield self.collate([self.decode(reader.row(sample_id)) for sample_id in batch])
                reader.advance(batch)
        finally:
            reader.close()


class _UnitReader(_ShardReader):
    """The tar reader's window and prefetch plan, over row groups: a unit's rows are
    fetched (range reads of its column chunks) and held while its shuffle block is read."""

    def __init__(self, dataset: TableStream, batches: list[list[int]]) -> None:
        self.dataset = dataset
        self._rows: OrderedDict[int, list[Any]] = OrderedDict()
        self._parsed = self._rows  # type: ignore[assignment]  # what _ShardReader's helpers see as held
        self._upcoming = self._shard_sequence(dataset, batches)
        self._first_need = {unit: index for index, unit in reversed(list(enumerate(self._upcoming)))}
        self._position = 0
        self._pool = ThreadPoolExecutor(max(1, dataset.prefetch_shards), thread_name_prefix="skylift-prefetch")
        self._futures: dict[int, Future[Any]] = {}
        self._fetch_error = None
        self._schedule()

    def row(self, sample_id: int) -> Any:
        unit_number, position = self.dataset.locate(sample_id)
        if unit_number not in self._rows:
            future = self._futures.pop(unit_number, None)
            self._rows[unit_number] = future.result() if future is not None else self._read(unit_number)
            while len(self._rows) > self.dataset.shuffle_block_shards + 1:
                self._rows.popitem(last=False)
        self._rows.move_to_end(unit_number)
        return self._rows[unit_number][position]

    def _schedule(self) -> None:
        window = self._upcoming[self._position : self._position + self.dataset.prefetch_shards + 1]
        for unit_number in window:
            if unit_number not in self._futures and unit_number not in self._rows:
                self._futures[unit_number] = self._pool.submit(self._read, unit_number)

    def _read(self, unit_number: int) -> list[Any]:
        dataset: TableStream = self.dataset  # type: ignore[assignment]
        unit = dataset.units[unit_number]
        dataset.fetched.append(unit.name)
        return dataset.source.read_unit(unit)


class TableEval(IterableDataset):
    """Every row of ``units`` once, in batches of ``batch_size``: after :meth:`place`, rank
    ``r`` of ``W`` reads the ``r``-th of ``W`` contiguous row ranges of equal size (the last
    shorter), fetching only the units that hold them (as
    :class:`~skylift.data.sampler.ShardedEvalSampler` cuts an in-memory set), so every rank
    has rows to score whenever there are as many rows as ranks."""

    def __init__(self, source: TableSource, units: list[TableUnit], *, decode: Decode,
                 collate: Callable[[list[Any]], Any], batch_size: int) -> None:  # fmt: skip
        self.source, self.units, self.decode, self.collate = source, units, decode, collate
        self.batch_size = batch_size
        self.num_rows = sum(unit.num_rows for unit in units)
        self.first, self.stop = 0, self.num_rows

    def place(self, rank: int, world_size: int) -> None:
        per_rank = math.ceil(self.num_rows / world_size)
        self.first, self.stop = min(rank * per_rank, self.num_rows), min((rank + 1) * per_rank, self.num_rows)

    def __len__(self) -> int:
        return math.ceil((self.stop - self.first) / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        pending: list[Any] = []
        offset = 0  # the first row of the unit at hand
        for unit in self.units:
            begin, end = max(self.first - offset, 0), min(self.stop - offset, unit.num_rows)
            offset += unit.num_rows
            if begin >= end:
                continue
            for row in self.source.read_unit(unit)[begin:end]:
                pending.append(self.decode(row))
                if len(pending) == self.batch_size:
                    yield self.collate(pending)
                    pending = []
        if pending:
            yield self.collate(pending)

"""Stream a sharded dataset from object storage with prefetch, a bounded cache and exact resume.

Order. Each epoch permutes the shards (seeded), groups them into shuffle blocks of
``shuffle_block_shards`` shards, and permutes the samples inside each block. That
global sequence is cut into global batches; rank ``r`` of ``W`` takes the ``r``-th
slice of each and splits it into ``accumulation_steps`` micro-batches; DataLoader
worker ``w`` of ``n`` produces this rank's micro-batches ``w, w + n, ...`` (the
DataLoader returns them round-robin, so in order). The global order therefore does
not depend on the number of ranks or workers, every sample appears once per epoch
(the last partial global batch is dropped), and a resume at global step ``s`` is
exact: skip the first ``s`` global batches.

Speed. A background thread per worker downloads the shards its next micro-batches
need, ``prefetch_shards`` ahead, into a node-wide :class:`ShardCache`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from skylift.data.images import augmentation_seed, seeded
from skylift.data.shard_cache import ShardCache
from skylift.data.shards import ShardIndex, ShardInfo, read_index, read_shard_samples
from skylift.storage import Store, open_store

__all__ = ["EvalStream", "StreamingDataset", "TarSamples"]

Decoder = Callable[[dict[str, bytes]], Any]


class StreamingDataset(IterableDataset):
    """An IterableDataset of this rank's micro-batches; use it with ``DataLoader(batch_size=None)``.

    Args:
        url: the dataset (a folder or object-store URL holding ``index.json``).
        decode: sample fields (name -> bytes) to what ``collate`` batches.
        global_batch_size, accumulation_steps, rank, world_size: as in
            :class:`~skylift.data.sampler.GlobalBatchSampler`.
        cache_dir, cache_limit_bytes: the node-wide shard cache and its bound.
        prefetch_shards: shards downloaded ahead of the one being read.
        shuffle_block_shards: shards whose samples are shuffled together.
    """

    def __init__(
        self,
        url: str,
        *,
        decode: Decoder,
        global_batch_size: int,
        cache_dir: str,
        cache_limit_bytes: int,
        accumulation_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        prefetch_shards: int = 4,
        shuffle_block_shards: int = 4,
        collate: Callable[[list[Any]], Any] = default_collate,
        endpoint_url: str | None = None,
        store: Store | None = None,
    ) -> None:
        self.store = store or open_store(url, endpoint_url=endpoint_url)
        self._set_order(read_index(self.store), global_batch_size=global_batch_size, seed=seed, shuffle=shuffle,
                        accumulation_steps=accumulation_steps, shuffle_block_shards=shuffle_block_shards)
        self.place(rank, world_size)
        largest = max(shard.size for shard in self.index.shards)
        if cache_limit_bytes < largest * (prefetch_shards + 1):
            raise ValueError(
                f"data.cache_limit_gib ({cache_limit_bytes / 2**30:.4f} GiB) must hold the shard being read plus "
                f"{prefetch_shards} prefetched ({prefetch_shards + 1} x {largest / 2**20:.2f} MiB); raise it or "
                "lower data.prefetch_shards"
            )
        self.decode, self.collate = decode, collate
        self.cache_dir, self.cache_limit_bytes = cache_dir, cache_limit_bytes
        self.prefetch_shards = prefetch_shards

    def _set_order(self, index: ShardIndex, *, global_batch_size: int, accumulation_steps: int, seed: int,
                   shuffle: bool, shuffle_block_shards: int) -> None:
        """What the epoch's order is made of (shared with other sharded sources, such as
        :class:`~skylift.data.table_stream.TableStream`, whose "shards" are row groups)."""
        self.index = index
        self.global_batch_size, self.accumulation_steps = global_batch_size, accumulation_steps
        self.seed, self.shuffle, self.shuffle_block_shards = seed, shuffle, shuffle_block_shards
        self.rank, self.world_size = 0, 1
        self.epoch, self.start_step = 0, 0
        self._offsets = _offsets(index.shards)

    def place(self, rank: int, world_size: int) -> None:
        """This process's place in the job (the global order does not depend on it)."""
        per_step = world_size * self.accumulation_steps
        if self.global_batch_size % per_step:
            raise ValueError(
                f"data.global_batch_size ({self.global_batch_size}) must divide by world_size x accumulation.steps "
                f"({per_step})"
            )
        self.rank, self.world_size = rank, world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.index.num_samples // self.global_batch_size

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.world_size * self.accumulation_steps)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = epoch, start_step

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start_step": self.start_step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.set_epoch(int(state["epoch"]), int(state["start_step"]))

    def __len__(self) -> int:
        """Micro-batches this rank yields for the rest of the epoch (all workers together)."""
        return (self.steps_per_epoch - self.start_step) * self.accumulation_steps

    def global_order(self) -> list[int]:
        """Every sample id of the epoch in training order (ids count through the shards)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        count = len(self.index.shards)
        shard_order = torch.randperm(count, generator=generator).tolist() if self.shuffle else list(range(count))
        order: list[int] = []
        for start in range(0, count, self.shuffle_block_shards):
            block = [
                self._offsets[shard] + offset
                for shard in shard_order[start : start + self.shuffle_block_shards]
                for offset in range(self.index.shards[shard].num_samples)
            ]
            if self.shuffle:
                block = [block[i] for i in torch.randperm(len(block), generator=generator).tolist()]
            order += block
        return order

    def micro_batches(self) -> list[list[int]]:
        """This rank's micro-batches (sample ids) from ``start_step`` to the epoch's end."""
        order, per_rank, micro = self.global_order(), self.global_batch_size // self.world_size, self.micro_batch_size
        batches = []
        for step in range(self.start_step, self.steps_per_epoch):
            begin = step * self.global_batch_size + self.rank * per_rank
            mine = order[begin : begin + per_rank]
            batches += [mine[offset : offset + micro] for offset in range(0, per_rank, micro)]
        return batches

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker else (0, 1)
        mine = self.micro_batches()[worker_id::num_workers]
        reader = _ShardReader(self, ShardCache(self.store, self.cache_dir, limit_bytes=self.cache_limit_bytes), mine)
        try:
            for batch in mine:
                yield self.collate([self._decode(reader, sample_id) for sample_id in batch])
                reader.advance(batch)
        finally:
            reader.close()

    def _decode(self, reader: _ShardReader, sample_id: int) -> Any:
        # Seeded per (run, epoch, sample): augmentation does not depend on the worker or a resume.
        with seeded(augmentation_seed(self.seed, self.epoch, sample_id)):
            return self.decode(reader.sample(sample_id))

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(shard number, position in shard) of a sample id."""
        low, high = 0, len(self._offsets) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self._offsets[middle] <= sample_id:
                low = middle
            else:
                high = middle - 1
        return low, sample_id - self._offsets[low]


class _ShardReader:
    """Parsed shards held in memory for the current shuffle block, plus the prefetcher."""

    def __init__(self, dataset: StreamingDataset, cache: ShardCache, batches: list[list[int]]) -> None:
        self.dataset, self.cache = dataset, cache
        self._parsed: OrderedDict[int, TarSamples] = OrderedDict()
        self._upcoming = self._shard_sequence(dataset, batches)
        self._first_need = {shard: index for index, shard in reversed(list(enumerate(self._upcoming)))}
        self._position = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, dataset.prefetch_shards), thread_name_prefix="skylift-prefetch")
        self._futures: dict[int, Future[bytes]] = {}
        self._fetch_error: BaseException | None = None
        self._schedule()

    def sample(self, sample_id: int) -> dict[str, bytes]:
        shard_number, position = self.dataset.locate(sample_id)
        if shard_number not in self._parsed:
            self._parsed[shard_number] = TarSamples(self._bytes(shard_number))
            while len(self._parsed) > self.dataset.shuffle_block_shards + 1:
                self._parsed.popitem(last=False)
        self._parsed.move_to_end(shard_number)
        return self._parsed[shard_number][position]

    def advance(self, batch: list[int]) -> None:
        """Note the shards ``batch`` used, so prefetching moves ahead of them."""
        for sample_id in batch:
            shard_number = self.dataset.locate(sample_id)[0]
            self._position = max(self._position, self._first_need.get(shard_number, 0))
        self._schedule()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _bytes(self, shard_number: int) -> bytes:
        self._raise_fetch_error()
        future = self._futures.pop(shard_number, None)
        if future is not None:
            return future.result()
        return self.cache.read(self._info(shard_number), self._keep())

    def _schedule(self) -> None:
        self._raise_fetch_error()
        window = self._upcoming[self._position : self._position + self.dataset.prefetch_shards + 1]
        for shard_number in window:
            if shard_number not in self._futures and shard_number not in self._parsed:
                future: Future[bytes] = Future()
                self._futures[shard_number] = future
                self._pool.submit(self._fetch, self._info(shard_number), self._keep(), future)

    def _fetch(self, info: ShardInfo, keep: frozenset[str], future: Future[bytes]) -> None:
        """Resolve ``future`` as soon as the shard is verified; the cache write follows."""
        try:
            self.cache.read(info, keep, ready=future.set_result)
        except BaseException as error:  # noqa: BLE001 - handed to the reading thread, never dropped
            if not future.done():
                future.set_exception(error)
            else:  # the bytes were delivered, then the cache write failed
                self._fetch_error = error

    def _raise_fetch_error(self) -> None:
        if self._fetch_error is not None:
            raise self._fetch_error

    def _keep(self) -> frozenset[str]:
        # Shards already parsed live in memory; only those still to be read must stay on
        # disk, and the one being fetched is not on disk yet.
        window = self._upcoming[self._position + 1 : self._position + self.dataset.prefetch_shards + 1]
        return frozenset(self._info(number).name for number in window)

    def _info(self, shard_number: int) -> ShardInfo:
        return self.dataset.index.shards[shard_number]

    @staticmethod
    def _shard_sequence(dataset: StreamingDataset, batches: list[list[int]]) -> list[int]:
        """Shards in the order this worker's ``batches`` first need them."""
        sequence: list[int] = []
        for batch in batches:
            for sample_id in batch:
                shard_number = dataset.locate(sample_id)[0]
                if sequence and sequence[-1] == shard_number:
                    continue
                if shard_number not in sequence[-dataset.shuffle_block_shards - 1 :]:
                    sequence.append(shard_number)
        return sequence


class TarSamples:
    """The samples of one tar shard, found by reading only its 512-byte member headers.

    A sample's fields are copied out of the shard when it is asked for, so a worker that
    uses half of a shard's samples (two workers share every shuffle block) copies half,
    and no ``TarInfo`` objects are built: ``tarfile`` spent more time parsing headers
    than the download took. The shard's bytes were verified against its sha256 before
    they got here. Tars this does not know (pax or GNU headers, which ``ShardWriter``
    never writes) go through :func:`~skylift.data.shards.read_shard_samples` instead,
    with the same result.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        located = _locate_ustar_samples(data)
        self._parsed = list(read_shard_samples(data)) if located is None else None
        self._located = located or []

    def __len__(self) -> int:
        return len(self._parsed) if self._parsed is not None else len(self._located)

    def __getitem__(self, position: int) -> dict[str, bytes]:
        if self._parsed is not None:
            return self._parsed[position]
        data = self.data
        return {name: data[start : start + size] for name, (start, size) in self._located[position].items()}

    def __iter__(self) -> Iterator[dict[str, bytes]]:
        return (self[position] for position in range(len(self)))


_TAR_BLOCK = 512
_REGULAR_TYPES = (b"0", b"\0", b"7")
_SKIPPED_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, folders: not sample fields


def _locate_ustar_samples(data: bytes) -> list[dict[str, tuple[int, int]]] | None:
    """Per sample, field -> (offset, size) of its bytes; None for anything but plain POSIX ustar."""
    samples: list[dict[str, tuple[int, int]]] = []
    sample: dict[str, tuple[int, int]] = {}
    current_key, offset = None, 0
    while offset + _TAR_BLOCK <= len(data):
        header = data[offset : offset + _TAR_BLOCK]
        if header[0] == 0:  # end-of-archive blocks
            break
        typeflag, size_field = header[156:157], header[124:136]
        if header[257:265] != b"ustar\x0000" or size_field[0] & 0x80:  # GNU, v7, or a base-256 size
            return None
        size = int(size_field.rstrip(b" \0") or b"0", 8)
        start = offset + _TAR_BLOCK
        offset = start + -(-size // _TAR_BLOCK) * _TAR_BLOCK
        name = header[:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
        if typeflag in _SKIPPED_TYPES or name.endswith(b"/"):
            continue
        if typeflag not in _REGULAR_TYPES:
            return None
        key, _, field_name = name.decode("utf-8", "surrogateescape").partition(".")
        if current_key is not None and key != current_key:
            samples.append(sample)
            sample = {}
        current_key = key
        sample[field_name] = (start, size)
    if sample:
        samples.append(sample)
    return samples


def _offsets(shards: list[ShardInfo]) -> list[int]:
    offsets, total = [], 0
    for shard in shards:
        offsets.append(total)
        total += shard.num_samples
    return offsets


class EvalStream(IterableDataset):
    """Every sample of a sharded dataset exactly once, in batches: rank ``r`` reads shards
    ``r, r + W, ...`` in order. Ranks may get different numbers of batches (evaluation
    sums are all-reduced once at the end, never per batch)."""

    def __init__(
        self,
        url: str,
        *,
        decode: Decoder,
        batch_size: int,
        cache_dir: str,
        cache_limit_bytes: int,
        rank: int = 0,
        world_size: int = 1,
        collate: Callable[[list[Any]], Any] = default_collate,
        endpoint_url: str | None = None,
    ) -> None:
        self.store = open_store(url, endpoint_url=endpoint_url)
        self.index = read_index(self.store)
        self.decode, self.collate, self.batch_size = decode, collate, batch_size
        self.cache_dir, self.cache_limit_bytes = cache_dir, cache_limit_bytes
        self.shards = self.index.shards[rank::world_size]

    def __iter__(self) -> Iterator[Any]:
        cache = ShardCache(self.store, self.cache_dir, limit_bytes=self.cache_limit_bytes)
        pending: list[Any] = []
        for shard in self.shards:
            for sample in TarSamples(cache.read(shard)):
                pending.append(self.decode(sample))
                if len(pending) == self.batch_size:
                    yield self.collate(pending)
                    pending = []
        if pending:
            yield self.collate(pending)

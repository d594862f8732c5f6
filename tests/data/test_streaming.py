"""Shards and streaming: exactly once, rank-independent order, exact resume, bounded cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from skylift.data.codecs import encode_array, tuple_decoder
from skylift.data.shard_cache import CorruptShardError
from skylift.data.shards import ShardWriter, read_index, read_shard_samples
from skylift.data.streaming import StreamingDataset
from skylift.storage import StorageNotFoundError, open_store

NUM_SAMPLES = 300


def _write_dataset(store, shard_size_bytes=8 * 1024):
    writer = ShardWriter(store, shard_size_bytes=shard_size_bytes)
    for index in range(NUM_SAMPLES):
        writer.add({"npy": encode_array(np.full((4,), index, dtype=np.int64)), "cls": str(index % 7).encode()})
    return writer.close()


@pytest.fixture
def dataset_store(tmp_path):
    store = open_store(str(tmp_path / "shards"))
    _write_dataset(store)
    return store


def _dataset(store, tmp_path, **options):
    settings = dict(decode=tuple_decoder("npy", "cls"), global_batch_size=20, cache_dir=str(tmp_path / "cache"),
                    cache_limit_bytes=1 << 20, seed=5, store=store, shuffle_block_shards=2, prefetch_shards=2)
    settings.update(options)
    return StreamingDataset(store.url, **settings)


def _ids(batch) -> list[int]:
    return batch[0][:, 0].tolist()


def _epoch(store, tmp_path, *, world_size=1, accumulation_steps=1, num_workers=0, epoch=0, start_step=0, **options):
    """The samples of each optimizer step, gathered over ranks (and workers) in order."""
    per_rank = []
    for rank in range(world_size):
        dataset = _dataset(store, tmp_path, rank=rank, world_size=world_size,
                           accumulation_steps=accumulation_steps, **options)
        dataset.set_epoch(epoch, start_step)
        loader = DataLoader(dataset, batch_size=None, num_workers=num_workers)
        micro = [_ids(batch) for batch in loader]
        assert len(micro) == len(dataset)
        per_rank.append([sum(micro[i : i + accumulation_steps], []) for i in range(0, len(micro), accumulation_steps)])
    return [sorted(sum((steps[i] for steps in per_rank), [])) for i in range(len(per_rank[0]))]


def test_shards_are_plain_tar_with_an_index(dataset_store):
    index = read_index(dataset_store)
    assert index.num_samples == NUM_SAMPLES and len(index.shards) > 5
    assert index.fields == ["cls", "npy"]
    first = list(read_shard_samples(dataset_store.read_bytes(index.shards[0].name)))
    assert len(first) == index.shards[0].num_samples and set(first[0]) == {"cls", "npy"}


def test_rewriting_is_deterministic_and_resumable(dataset_store):
    again = ShardWriter(dataset_store, shard_size_bytes=8 * 1024)
    for index in range(NUM_SAMPLES):
        again.add({"npy": encode_array(np.full((4,), index, dtype=np.int64)), "cls": str(index % 7).encode()})
    assert again.close() == read_index(dataset_store)
    assert again.reused == len(again.shards)


def test_missing_index_says_how_to_create_it(tmp_path):
    with pytest.raises(StorageNotFoundError, match="skylift shard SOURCE"):
        _dataset(open_store(str(tmp_path / "empty")), tmp_path)


def test_every_sample_once_per_epoch_over_two_ranks_and_two_workers(dataset_store, tmp_path):
    steps = _epoch(dataset_store, tmp_path, world_size=2, num_workers=2)
    flat = sum(steps, [])
    assert len(flat) == len(set(flat)) == (NUM_SAMPLES // 20) * 20
    assert _epoch(dataset_store, tmp_path, world_size=2, num_workers=2, epoch=1) != steps


def test_global_order_does_not_depend_on_ranks_workers_or_accumulation(dataset_store, tmp_path):
    single = _epoch(dataset_store, tmp_path)
    assert _epoch(dataset_store, tmp_path, world_size=2, num_workers=2) == single
    assert _epoch(dataset_store, tmp_path, world_size=4, accumulation_steps=1) == single
    assert _epoch(dataset_store, tmp_path, world_size=1, accumulation_steps=2, num_workers=2) == single


def test_resume_mid_epoch_loses_and_repeats_nothing_even_on_fewer_ranks(dataset_store, tmp_path):
    full = _epoch(dataset_store, tmp_path, world_size=2, num_workers=2)
    resumed_on_one_rank = _epoch(dataset_store, tmp_path, world_size=1, start_step=6)
    assert resumed_on_one_rank == full[6:]


def test_cache_stays_under_its_limit(dataset_store, tmp_path):
    index = read_index(dataset_store)
    largest = max(shard.size for shard in index.shards)
    limit = largest * 3  # a shuffle block of 2 plus one
    dataset = _dataset(dataset_store, tmp_path, cache_limit_bytes=limit)
    assert sum(shard.size for shard in index.shards) > 2 * limit
    from skylift.data.shard_cache import ShardCache

    cache = ShardCache(dataset_store, tmp_path / "cache", limit_bytes=limit)
    peak = 0
    for _ in DataLoader(dataset, batch_size=None):
        peak = max(peak, cache.cached_bytes())
    assert 0 < peak <= limit


def test_cache_limit_too_small_is_a_clear_error(dataset_store, tmp_path):
    with pytest.raises(ValueError, match="data.cache_limit_gib"):
        _dataset(dataset_store, tmp_path, cache_limit_bytes=100)


def test_damaged_cached_shard_is_detected_and_fetched_again(dataset_store, tmp_path, caplog):
    reference = _epoch(dataset_store, tmp_path)
    for path in (tmp_path / "cache").rglob("shard-*.tar"):
        data = bytearray(path.read_bytes())
        data[600] ^= 0xFF
        path.write_bytes(bytes(data))
    assert _epoch(dataset_store, tmp_path) == reference
    assert "failed its sha256 check" in caplog.text


def test_damaged_source_shard_fails_naming_it(dataset_store, tmp_path):
    name = read_index(dataset_store).shards[3].name
    data = bytearray(dataset_store.read_bytes(name))
    data[700] ^= 0xFF
    dataset_store.write_bytes(name, bytes(data))
    with pytest.raises(CorruptShardError, match=name):
        _epoch(dataset_store, tmp_path)


def test_s3_restart_mid_epoch_completes_with_every_sample_once(moto_server, s3_bucket, tmp_path):
    from skylift.storage import RetryPolicy

    retry = RetryPolicy(max_attempts=30, base_delay_s=0.05, max_delay_s=0.5, deadline_s=30)
    store = open_store(f"s3://{s3_bucket}/data", endpoint_url=moto_server.endpoint_url, retry=retry)
    _write_dataset(store)
    dataset = _dataset(store, tmp_path, prefetch_shards=1)
    seen, restart = [], None
    for number, batch in enumerate(DataLoader(dataset, batch_size=None)):
        seen += _ids(batch)
        if number == 3:
            restart = moto_server.restart_after(1.0)
    restart.join()
    assert sorted(seen) == sorted(set(seen)) and len(seen) == (NUM_SAMPLES // 20) * 20
    assert retry.attempts_log, "the restart must have been retried through"
    assert torch.tensor(seen).unique().numel() == len(seen)


def test_a_cache_write_that_fails_after_the_bytes_were_handed_over_still_stops_the_epoch(
    dataset_store, tmp_path, monkeypatch
):
    """Prefetched bytes reach the reader before they are written into the cache; a
    failure of that write (a full disk) must surface, not vanish with the thread."""
    import errno

    from skylift.data import shard_cache

    def disk_full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_cache, "_stamp", disk_full)
    with pytest.raises(OSError, match="No space left"):
        for _ in DataLoader(_dataset(dataset_store, tmp_path), batch_size=None):
            pass

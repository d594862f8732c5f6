"""Table sources: Parquet files and Hugging Face datasets read where they live (a local
folder, moto's S3 on 127.0.0.1), a row group fetched when the order needs it, in the tar
shards' order: every row once per epoch, rank-independent, exact resume; clear errors."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from skylift.data.chat import Conversation
from skylift.data.table_rows import is_table_source, open_table_source
from skylift.data.table_stream import TableEval, TableStream
from skylift.errors import SkyliftConfigError
from skylift.storage import open_store
from tests.servers import FaultyProxy

FILES, ROWS_PER_FILE, ROWS_PER_GROUP = 3, 40, 10


def chat_rows(count: int, start: int = 0, filler_bytes: int = 0) -> list[dict]:
    """Chats whose assistant answer is the row's number (so a row names itself); with
    ``filler_bytes`` of seeded random hex in the question, which no codec shrinks."""
    def question(index: int) -> str:
        filler = random.Random(index).randbytes(filler_bytes // 2).hex()
        return f"number {index}? {filler}".strip()

    return [{"messages": [{"role": "user", "content": question(index)},
                          {"role": "assistant", "content": str(index)}], "id": index}
            for index in range(start, start + count)]  # fmt: skip


def parquet_bytes(rows: list[dict], row_group_size: int = ROWS_PER_GROUP) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=row_group_size)
    return sink.getvalue().to_pybytes()


def write_chat_parquet(store, filler_bytes: int = 0) -> None:
    """FILES files of ROWS_PER_FILE chats, each in row groups of ROWS_PER_GROUP."""
    for number in range(FILES):
        rows = chat_rows(ROWS_PER_FILE, number * ROWS_PER_FILE, filler_bytes)
        store.write_bytes(f"train-{number:05d}-of-{FILES:05d}.parquet", parquet_bytes(rows))


def _row_number(row: Conversation) -> int:
    return int(row.messages[-1]["content"])


def _stream(source, **options):
    settings = dict(decode=_row_number, collate=list, global_batch_size=12, accumulation_steps=1, seed=3,
                    prefetch_shards=1, shuffle_block_shards=2)
    settings.update(options)
    return TableStream(source, source.units, **settings)


def _epoch(source, *, world_size=1, num_workers=0, start_step=0, epoch=0) -> list[list[int]]:
    """The rows of each optimizer step, gathered over the ranks (and workers), sorted."""
    per_rank = []
    for rank in range(world_size):
        stream = _stream(source)
        stream.place(rank, world_size)
        stream.set_epoch(epoch, start_step)
        per_rank.append(list(DataLoader(stream, batch_size=None, num_workers=num_workers)))
    return [sorted(sum((steps[i] for steps in per_rank), [])) for i in range(len(per_rank[0]))]


@pytest.fixture
def local_source(tmp_path):
    write_chat_parquet(open_store(str(tmp_path / "chats")))
    return open_table_source(str(tmp_path / "chats"), "recipe.train_path")


def test_a_folder_of_parquet_files_is_its_row_groups(local_source):
    assert local_source.format == "parquet" and local_source.columns == ("messages",)  # "id" is never read
    assert [unit.num_rows for unit in local_source.units] == [ROWS_PER_GROUP] * (FILES * ROWS_PER_FILE // ROWS_PER_GROUP)
    rows = local_source.read_unit(local_source.units[5])
    assert [_row_number(row) for row in rows] == list(range(50, 60))
    assert rows[0].where.endswith("train-00001-of-00003.parquet row 10")


def test_every_row_once_per_epoch_over_two_ranks_and_two_workers(local_source):
    steps = _epoch(local_source, world_size=2, num_workers=2)
    flat = sum(steps, [])
    assert len(steps) == FILES * ROWS_PER_FILE // 12 and sorted(flat) == list(range(FILES * ROWS_PER_FILE))
    assert _epoch(local_source) == steps  # the order does not depend on ranks or workers
    assert _epoch(local_source, epoch=1) != steps


def test_resume_mid_epoch_onto_another_world_size_loses_and_repeats_nothing(local_source):
    full = _epoch(local_source, world_size=2)
    assert _epoch(local_source, world_size=1, start_step=4) == full[4:]
    assert _epoch(local_source, world_size=4, start_step=7) == full[7:]


def test_rows_come_from_s3_a_row_group_at_a_time(moto_server, s3_bucket):
    proxy = FaultyProxy(moto_server.port)
    try:
        store = open_store(f"s3://{s3_bucket}/chats", endpoint_url=moto_server.endpoint_url)
        # Row groups of ~100 KB: pyarrow reads a footer with one 64 KB read from the file's end.
        write_chat_parquet(store, filler_bytes=10_000)
        total_bytes = sum(store.size(key) for key in store.list())
        source = open_table_source(f"s3://{s3_bucket}/chats", "recipe.train_path", endpoint_url=proxy.endpoint_url)
        opened = list(proxy.answered)
        # Opening lists the folder and reads each file's footer: no row group yet.
        assert sum(size for _, _, size in opened) < total_bytes / 3, opened
        stream = _stream(source)
        first_step = next(iter(DataLoader(stream, batch_size=None)))
        # The first step's rows come from the first shuffle block (2 row groups) of 12; the
        # prefetcher may have asked for one more. Each row group is a few range reads.
        assert len(first_step) == 12 and 1 <= len(stream.fetched) <= 3, stream.fetched
        before_first_step = proxy.answered[len(opened):]
        assert all(method == "GET" for method, _, _ in before_first_step)
        assert sum(size for _, _, size in before_first_step) < total_bytes / 3, before_first_step
        assert {number // ROWS_PER_GROUP for number in first_step} <= {
            int(name.split("-")[1]) * ROWS_PER_FILE // ROWS_PER_GROUP + int(name.split("#")[1])
            for name in stream.fetched}  # fmt: skip
    finally:
        proxy.close()


def test_a_glob_picks_one_split_of_a_hugging_face_layout(tmp_path):
    store = open_store(str(tmp_path / "hub"))
    store.write_bytes("data/train-00000-of-00001.parquet", parquet_bytes(chat_rows(20)))
    store.write_bytes("data/test-00000-of-00001.parquet", parquet_bytes(chat_rows(5, 100)))
    train = open_table_source(str(tmp_path / "hub" / "data" / "train-*.parquet"), "recipe.train_path")
    assert train.num_rows == 20
    assert open_table_source(str(tmp_path / "hub"), "recipe.train_path").num_rows == 25
    single = open_table_source(str(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet"), "recipe.val_path")
    assert single.num_rows == 5 and is_table_source(str(tmp_path / "hub" / "data" / "x.parquet"))


def test_a_dataset_saved_with_save_to_disk_is_read_from_its_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"after {index} comes", "completion": f" {index + 1}"} for index in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    source = open_table_source(str(tmp_path / "saved"), "recipe.train_path")
    assert source.format == "save_to_disk" and source.columns == ("prompt", "completion")
    assert [unit.num_rows for unit in source.units] == [10, 10, 10]
    evaluation = TableEval(source, source.units, decode=lambda row: row["completion"], collate=list, batch_size=7)
    evaluation.place(1, 2)  # rank 1 of 2: rows 15 to 29, in the second and third Arrow files
    assert sum(evaluation, []) == [f" {index + 1}" for index in range(15, 30)] and len(evaluation) == 3
    evaluation.place(0, 2)
    assert sum(evaluation, []) == [f" {index + 1}" for index in range(15)]


def test_a_missing_column_names_the_columns_present_and_the_fix(tmp_path):
    store = open_store(str(tmp_path / "bad"))
    store.write_bytes("part.parquet", parquet_bytes([{"question": "a", "answer": "b"}]))
    with pytest.raises(SkyliftConfigError, match=r"recipe.train_path: .*part.parquet has the columns "
                       r"\['answer', 'question'\], none of the document columns") as caught:  # fmt: skip
        open_table_source(str(tmp_path / "bad"), "recipe.train_path")
    assert "rename_column" in str(caught.value)


def test_an_unknown_format_is_named(tmp_path):
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "rows.csv").write_text("text\nhello\n")
    with pytest.raises(SkyliftConfigError, match=r"is not a table source in a known format \(it holds rows.csv\)"):
        open_table_source(str(tmp_path / "csvs"), "recipe.train_path")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(SkyliftConfigError, match="fake.parquet is not a Parquet file"):
        open_table_source(str(tmp_path / "fake.parquet"), "recipe.train_path")


def test_save_to_disk_in_an_object_store_says_to_write_parquet(moto_server, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/saved", endpoint_url=moto_server.endpoint_url)
    store.write_bytes("state.json", b'{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    with pytest.raises(SkyliftConfigError, match="save_to_disk") as caught:
        open_table_source(f"s3://{s3_bucket}/saved", "recipe.train_path", endpoint_url=moto_server.endpoint_url)
    assert "Dataset.to_parquet" in str(caught.value)


def test_fewer_rows_than_a_global_batch_is_a_clear_error(local_source):
    with pytest.raises(SkyliftConfigError, match="fewer than one global batch"):
        _stream(local_source, global_batch_size=1024)


def test_decoded_rows_are_batched_by_the_collate(local_source):
    stream = _stream(local_source, decode=lambda row: torch.tensor([_row_number(row)]), collate=torch.stack)
    batch = next(iter(DataLoader(stream, batch_size=None)))
    assert batch.shape == (12, 1)

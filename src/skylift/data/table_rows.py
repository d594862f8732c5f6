"""Documents from Parquet files and Hugging Face datasets, read where they live.

A table source is a ``.parquet`` file, a folder of them (a Hugging Face dataset's
Parquet shards; a last path part with ``*`` picks some, ``data/train-*.parquet``), or
a folder that ``datasets.Dataset.save_to_disk`` wrote (``state.json``, Arrow files),
in a local folder or at an ``s3://``, ``oss://``, ``cos://`` URL (through
:mod:`skylift.storage`). Opening one reads only each Parquet file's footer (its schema
and row groups); a row group's rows are fetched when a reader needs them, by range
reads of its column chunks, so training starts without downloading the dataset.

The unit of reading is the Parquet row group (a ``save_to_disk`` Arrow file, an IPC
stream without an index, is one unit). Rows carry the JSONL forms' columns: ``messages``
(a chat), or ``prompt`` and ``completion``, or ``text``, checked by the same rules
(:func:`skylift.data.jsonl_text.read_document_row`); other columns are not read.

Torch-free: the recipe's settings ask :func:`is_table_source` when a config is checked.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError
from skylift.storage import Store, open_store

__all__ = ["DOCUMENT_COLUMNS", "PREFERENCE_COLUMNS", "TableSource", "TableUnit", "is_table_source", "open_table_source"]

DOCUMENT_COLUMNS = (("messages",), ("prompt", "completion"), ("text",))
PREFERENCE_COLUMNS = (("messages", "chosen", "rejected"), ("prompt", "chosen", "rejected"))
"""The columns of preference pairs (``recipe.objective: dpo``), as in JSONL."""
"""The columns a row of documents holds, in the order they are looked for."""

_STATE = "state.json"
_FORMATS = ("a .parquet file, a folder of .parquet files (a Hugging Face dataset's Parquet shards), or a folder "
            "that datasets.Dataset.save_to_disk wrote (state.json and .arrow files)")


def is_table_source(path: str) -> bool:
    """Whether ``path`` names a table source rather than a local JSONL file: a URL, a
    ``.parquet`` file, a pattern or a folder."""
    if "://" in path and not path.startswith("file://"):
        return True
    local = path.removeprefix("file://")
    return local.endswith(".parquet") or "*" in Path(local).name or Path(local).is_dir()


@dataclass(frozen=True)
class TableUnit:
    """One row group of a Parquet file (``row_group``), or a whole Arrow file (None)."""

    key: str
    row_group: int | None
    num_rows: int
    size: int
    """Compressed bytes of the row group (of the Arrow file)."""

    @property
    def name(self) -> str:
        return self.key if self.row_group is None else f"{self.key}#{self.row_group}"


class TableSource:
    """The units and document columns of a table source; :meth:`read_unit` fetches one.

    Raises (on opening):
        SkyliftConfigError: naming ``field``: the source holds no table in a known form,
            or lacks the document columns (naming the columns it has and the fix).
    """

    def __init__(self, path: str, field: str, *, endpoint_url: str | None = None, preferences: bool = False) -> None:
        if importlib.util.find_spec("pyarrow") is None:
            raise SkyliftConfigError(f"{field}: {path} is read with pyarrow, which is not installed",
                                     hint="pip install -c requirements/constraints.txt -e '.[text]'")  # fmt: skip
        self.path, self.field, self.preferences = path, field, preferences
        root, pattern = _split(path)
        self.store: Store = open_store(root, endpoint_url=endpoint_url)
        self._footers: dict[str, Any] = {}
        """Each Parquet file's metadata (pyarrow's ``FileMetaData``), read once."""
        self._sizes: dict[str, int] = {}
        self.format, keys = self._find(pattern)
        self.units: list[TableUnit] = []
        self.columns: tuple[str, ...] = ()
        for key in keys:
            names, units = self._describe(key)
            columns = _document_columns(names, PREFERENCE_COLUMNS if preferences else DOCUMENT_COLUMNS)
            if columns is None and preferences:
                raise SkyliftConfigError(
                    f"{field}: {self.store.describe(key)} has the columns {sorted(names)}; recipe.objective: dpo "
                    "needs \"prompt\" (or \"messages\"), \"chosen\" and \"rejected\"",
                    hint="Rename the columns (datasets: Dataset.rename_column), or set recipe.objective: sft for "
                    "documents")  # fmt: skip
            if columns is None:
                raise SkyliftConfigError(
                    f"{field}: {self.store.describe(key)} has the columns {sorted(names)}, none of the document "
                    "columns: \"messages\" (a chat), or \"prompt\" and \"completion\", or \"text\"",
                    hint="Rename the column that holds the documents (datasets: Dataset.rename_column) or point "
                    f"{field} at another dataset")  # fmt: skip
            if self.columns and columns != self.columns:
                raise SkyliftConfigError(f"{field}: {self.store.describe(key)} holds {list(columns)}, the files "
                                         f"before it {list(self.columns)}: a dataset holds one layout",
                                         hint="Write every file of the dataset with the same columns")  # fmt: skip
            self.columns = columns
            self.units += units
        self.num_rows = sum(unit.num_rows for unit in self.units)
        if not self.num_rows:
            raise SkyliftConfigError(f"{field}: {self.store.describe()} holds no rows")

    def describe(self) -> str:
        files = len({unit.key for unit in self.units})
        return (f"{self.path} ({self.format}: {self.num_rows} rows in {len(self.units)} units of "
                f"{files} files, columns {list(self.columns)})")

    def read_unit(self, unit: TableUnit) -> list[Any]:
        """The rows of ``unit``, checked (:func:`~skylift.data.jsonl_text.read_document_row`, or
        :func:`~skylift.data.preference.read_preference_row` for preference pairs)."""
        from skylift.data.jsonl_text import read_document_row
        from skylift.data.preference import read_preference_row

        read_row = read_preference_row if self.preferences else read_document_row
        if unit.row_group is None:
            table = self._arrow_table(unit.key)
        else:
            table = self._parquet(unit.key).read_row_group(unit.row_group, columns=list(self.columns))
        first = sum(other.num_rows for other in self.units[: self.units.index(unit)] if other.key == unit.key)
        rows = table.select(list(self.columns)).to_pylist()
        return [read_row(row, f"{self.field}: {self.store.describe(unit.key)} row {first + number}")
                for number, row in enumerate(rows)]  # fmt: skip

    def _find(self, pattern: str | None) -> tuple[str, list[str]]:
        if pattern is not None and "*" not in pattern:  # one file
            if not self.store.exists(pattern):
                raise SkyliftConfigError(f"{self.field}: {self.store.describe(pattern)} does not exist")
            return "parquet", [pattern]
        keys = self.store.list()
        if pattern is None and _STATE in keys:
            return "save_to_disk", self._saved_files()
        names = [key for key in keys if fnmatch.fnmatch(key.rsplit("/", 1)[-1], pattern or "*.parquet")]
        parquet = [key for key in names if key.endswith(".parquet")]
        if not parquet:
            found = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "") if keys else "nothing"
            raise SkyliftConfigError(f"{self.field}: {self.path} is not a table source in a known format "
                                     f"(it holds {found})", hint=f"Point it at {_FORMATS}, or at a local JSONL file")
        return "parquet", sorted(parquet)

    def _saved_files(self) -> list[str]:
        from skylift.storage.local import LocalStore

        if not isinstance(self.store, LocalStore):
            raise SkyliftConfigError(
                f"{self.field}: {self.path} was written by save_to_disk, whose Arrow files are streams without an "
                "index (their rows are not counted without reading them whole)", hint="Write its Parquet shards "
                "there instead (Dataset.to_parquet, one file per shard), or copy the folder to a local disk")
        state = json.loads(self.store.read_bytes(_STATE))
        return [entry["filename"] for entry in state.get("_data_files", [])]

    def _describe(self, key: str) -> tuple[list[str], list[TableUnit]]:
        """The column names of ``key`` and its units."""
        if self.format == "save_to_disk":
            table = self._arrow_table(key, columns=None)
            return table.column_names, [TableUnit(key, None, table.num_rows, self.store.size(key))]
        try:
            metadata = self._parquet(key).metadata
        except Exception as error:  # noqa: BLE001 - pyarrow's errors name no file; this one does
            raise SkyliftConfigError(f"{self.field}: {self.store.describe(key)} is not a Parquet file ({error})",
                                     hint=f"Point it at {_FORMATS}") from None  # fmt: skip
        units = [TableUnit(key, number, metadata.row_group(number).num_rows,
                           metadata.row_group(number).total_byte_size) for number in range(metadata.num_row_groups)]
        return metadata.schema.to_arrow_schema().names, units  # fmt: skip

    def _parquet(self, key: str) -> Any:
        """A reader of ``key`` of its own (the prefetch threads read several row groups at
        once, and a file object has one position), from the footer read when it was opened."""
        import pyarrow.parquet as pq

        file = _StoreFile(self.store, key, self._sizes.get(key))
        reader = pq.ParquetFile(file, metadata=self._footers.get(key))
        self._footers[key], self._sizes[key] = reader.metadata, file.length
        return reader

    def _arrow_table(self, key: str, columns: tuple[str, ...] | None = ()) -> Any:
        import pyarrow as pa

        path = str(Path(self.store.url.removeprefix("file://")) / key)
        with pa.memory_map(path) as source:  # memory-mapped: counting rows reads no column data
            table = pa.ipc.open_stream(source).read_all()
        return table if columns is None else table.select(list(columns or self.columns))


def open_table_source(path: str, field: str, *, endpoint_url: str | None = None,
                      preferences: bool = False) -> TableSource:
    """The table source at ``path`` (see :class:`TableSource`); ``field`` names the setting;
    ``preferences``: rows of preference pairs (:data:`PREFERENCE_COLUMNS`)."""
    return TableSource(path, field, endpoint_url=endpoint_url, preferences=preferences)


def _split(path: str) -> tuple[str, str | None]:
    """(the folder or URL the store opens, the file name or pattern in it, or None)."""
    stripped = path.rstrip("/")
    last = stripped.rsplit("/", 1)[-1]
    if last.endswith(".parquet") or "*" in last:
        return stripped[: -len(last)].rstrip("/") or ".", last
    return stripped, None


def _document_columns(names: list[str], layouts: tuple[tuple[str, ...], ...]) -> tuple[str, ...] | None:
    for columns in layouts:
        if set(columns) <= set(names):
            return columns
    return None


class _StoreFile(io.RawIOBase):
    """A read-only, seekable file over one object of a store: pyarrow's Parquet reader
    asks for the footer and then for the column chunks it reads, each a range read."""

    def __init__(self, store: Store, key: str, length: int | None = None) -> None:
        self.store, self.key = store, key
        self.length = store.size(key) if length is None else length
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer: Any) -> int:
        end = min(self.position + len(buffer), self.length)
        if end <= self.position:
            return 0
        data = self.store.read_range(self.key, self.position, end)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)

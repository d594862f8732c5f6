"""The causal-LM recipe's table sources: Parquet files or a saved Hugging Face dataset,
streamed a row group at a time as training needs them (:mod:`skylift.data.table_stream`),
one document (or, under ``recipe.objective: dpo``, one preference pair) per sample.

Split from :mod:`skylift.recipes.causal_lm`, which calls :func:`table_datasets` when
``recipe.train_path`` is a table source (the settings refuse packing and token budgets
there: both need every document's tokens before the first step).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from skylift.data.datasets import DatasetSplit
from skylift.data.jsonl_text import IGNORE_INDEX, DocumentSequences, causal_collate, read_jsonl_documents
from skylift.data.preference import PreferencePairs, encode_preferences, preference_collate, read_preference_rows
from skylift.data.table_rows import is_table_source, open_table_source
from skylift.errors import SkyliftConfigError

__all__ = ["table_datasets"]

log = logging.getLogger("skylift")


def table_datasets(recipe: Any) -> DatasetSplit:
    """The training stream and validation set of ``recipe`` (a :class:`~skylift.recipes.causal_lm.CausalLM`)
    whose ``recipe.train_path`` is a table source."""
    from skylift.data.table_stream import TableEval, TableStream

    settings, data = recipe.settings, recipe.config.data
    pairs = recipe.dpo is not None
    source = open_table_source(settings.train_path, "recipe.train_path", endpoint_url=data.endpoint_url,
                               preferences=pairs)  # fmt: skip
    collate = preference_collate(recipe.pad_id) if pairs else causal_collate(recipe.pad_id)
    val: Any
    if settings.val_path is None:
        train_units, val_units = _hold_out_units(recipe, source.units)
        val = TableEval(source, val_units, decode=_row_decoder(recipe, "recipe.train_path (held out)"),
                        collate=collate, batch_size=data.eval_batch_size)  # fmt: skip
    elif is_table_source(settings.val_path):
        train_units = source.units
        val_source = open_table_source(settings.val_path, "recipe.val_path", endpoint_url=data.endpoint_url,
                                       preferences=pairs)  # fmt: skip
        val = TableEval(val_source, val_source.units, decode=_row_decoder(recipe, "recipe.val_path"),
                        collate=collate, batch_size=data.eval_batch_size)  # fmt: skip
    else:
        train_units = source.units
        read: Any = read_preference_rows if pairs else read_jsonl_documents
        val = recipe._sequences(read(Path(settings.val_path), "recipe.val_path"), "recipe.val_path")
    train = TableStream(source, train_units, decode=_row_decoder(recipe, "recipe.train_path"), collate=collate,
                        global_batch_size=data.global_batch_size, accumulation_steps=recipe.config.accumulation.steps,
                        seed=recipe.config.seed, prefetch_shards=data.prefetch_shards,
                        shuffle_block_shards=data.shuffle_block_shards)  # fmt: skip
    log.info("causal_lm: training on %s, %d %s in %d units read on demand (up to %d tokens a sequence); "
             "validation: %s", source.describe(), train.index.num_samples, "pairs" if pairs else "rows",
             len(train_units), settings.sequence_length,
             f"{sum(unit.num_rows for unit in val.units)} rows in {len(val.units)} units"
             if isinstance(val, TableEval) else f"{len(val)} {'pairs' if pairs else 'sequences'}")  # fmt: skip
    return DatasetSplit(train=train, val=val, num_classes=0, in_channels=0)


def _hold_out_units(recipe: Any, units: list[Any]) -> tuple[list[Any], list[Any]]:
    """A seeded draw of ``data.val_fraction`` of the source's units (row groups) for validation."""
    config = recipe.config
    order = torch.randperm(len(units), generator=torch.Generator().manual_seed(config.seed)).tolist()
    num_val = max(1, round(len(units) * config.data.val_fraction))
    if num_val >= len(units):
        raise SkyliftConfigError(f"recipe.train_path: its {len(units)} row groups leave none for training after "
                                 f"data.val_fraction ({config.data.val_fraction}): a table source holds "
                                 "out whole row groups", hint="Give recipe.val_path, or write the dataset in "
                                 "more row groups (pyarrow.parquet.write_table's row_group_size)")  # fmt: skip
    return [units[i] for i in sorted(order[num_val:])], [units[i] for i in sorted(order[:num_val])]


def _row_decoder(recipe: Any, field: str) -> Any:
    """A checked row -> its ``(input_ids, labels)`` sequence, cut at ``sequence_length``; a
    document of one token (nothing to predict) becomes one position with no target. Under
    DPO a row -> its pair's four tensors; a pair the cut leaves without a completion token
    on either side is an error naming the row (a stream cannot leave a sample out: every
    rank's batches are fixed before the rows are read)."""
    length = recipe.settings.sequence_length

    if recipe.dpo is not None:
        def decode_pair(row: Any) -> tuple[torch.Tensor, ...]:
            pairs = PreferencePairs(encode_preferences([row], recipe.tokenizer, field), length)
            if not pairs.pairs:
                raise SkyliftConfigError(
                    f"{field}: a pair whose prompt fills recipe.sequence_length ({length}) leaves its chosen or "
                    "rejected completion no token to score", hint="Raise recipe.sequence_length, or drop the "
                    "row from the dataset")  # fmt: skip
            return pairs.pairs[0]

        return decode_pair

    def decode(row: Any) -> tuple[torch.Tensor, torch.Tensor]:
        sequences = DocumentSequences(recipe._documents([row], field), length).sequences
        if sequences:
            return sequences[0]
        return torch.tensor([recipe.pad_id], dtype=torch.long), torch.tensor([IGNORE_INDEX], dtype=torch.long)

    return decode

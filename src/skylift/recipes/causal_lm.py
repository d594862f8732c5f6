"""Causal language-model fine-tuning: a Hugging Face ``AutoModelForCausalLM`` on JSONL
documents, or on a table source's rows (Parquet files, a Hugging Face dataset; local or in
an object store) streamed a row group at a time (:mod:`skylift.data.table_stream`).

The model and tokenizer come from a local folder (``recipe.model_path``), offline,
weights in fp32 (mixed precision computes in bf16 from fp32 master weights), or from
the built-in tiny Llama (:mod:`skylift.recipes.tiny_lm`). Documents are ``text`` rows,
``prompt``/``completion`` rows whose prompt is masked out of the loss
(:mod:`skylift.data.jsonl_text`), or chats (``messages`` rows) rendered by the
tokenizer's chat template with only the assistant turns learned
(:mod:`skylift.data.chat`), packed several to a sequence of up to ``sequence_length``
tokens, each attending only to itself (per-document position ids, from which
transformers builds the block-diagonal causal mask), or
one per sequence and padded per batch (with ``data.batching: token_budget``, sorted
into micro-batches of at most ``data.max_tokens`` padded tokens). With
``recipe.objective: dpo`` the rows are preferences (a prompt, a chosen and a rejected
completion, :mod:`skylift.data.preference`), learned with DPO's loss
(:mod:`skylift.recipes.preference`).

The loss of a step is the sum of its token losses over every micro-batch and rank
divided by the number of labelled tokens of the whole step (:meth:`CausalLM.loss_count`;
the Trainer weighs each micro-batch's mean by its count), not the mean of micro-batch
means, which would count a token of a micro-batch with few labelled tokens more than
one of a micro-batch with many. Evaluation reports the loss per labelled token and its
exponential, the perplexity, summed exactly across ranks.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from skylift.config.schema import RunConfig
from skylift.data.chat import Conversation
from skylift.data.datasets import DatasetSplit
from skylift.data.jsonl_text import (
    IGNORE_INDEX,
    DocumentSequences,
    EncodedDocument,
    PackedBlocks,
    PackedDocuments,
    causal_collate,
    encode_conversations,
    encode_documents,
    packed_collate,
    read_jsonl_documents,
)
from skylift.data.preference import (
    PreferencePairs,
    encode_preferences,
    preference_collate,
    read_preference_rows,
)
from skylift.data.table_rows import is_table_source
from skylift.errors import SkyliftConfigError
from skylift.recipes.base import Recipe
from skylift.recipes.hf_models import offline
from skylift.recipes.preference import REWARD_SCALARS, Reference, dpo_losses, pair_sums, sequence_log_probs
from skylift.recipes.reference_table import ReferenceTable, pair_keys, reference_fingerprint
from skylift.recipes.settings.causal_lm import TINY_LLAMA, CausalLMSettings

__all__ = ["PACKED_ATTENTION", "CausalLM", "check_packed_attention", "token_loss_sums"]

log = logging.getLogger("skylift")

Sequences = PackedDocuments | PackedBlocks | DocumentSequences | PreferencePairs
"""A split's training sequences, as ``recipe.packing`` and ``recipe.objective`` cut them."""

_INSTALL_HINT = "install skylift's text extra: pip install -c requirements/constraints.txt -e '.[text]'"


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy over the labelled positions of ``labels`` (shifted
    already: ``labels[b, t]`` is the target after position ``t``; -100 carries no loss),
    and how many there are."""
    # Under bf16 autocast cross_entropy computes in fp32 (it is on autocast's fp32 list).
    loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()


class CausalLM(Recipe):
    """Next-token cross-entropy per labelled token; see the module's docstring."""

    Settings = CausalLMSettings

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)  # validates the settings and checks them against the run's data section
        self.settings: CausalLMSettings
        self.builtin = self.settings.model_path == TINY_LLAMA
        self.folder = None if self.builtin else _model_folder(self.settings.model_path)
        self.tokenizer = self._tokenizer()
        self.pad_id = self._pad_id()
        dpo = self.settings.dpo if self.settings.objective == "dpo" else None
        self.dpo = dpo
        self.reference = Reference(str(dpo.reference), precomputed=dpo.precompute_reference) if dpo else None
        self.reference_table: ReferenceTable | None = None
        """``recipe.dpo.precompute_reference``: the values, once the trainer computed or read them."""
        self._step_sums: tuple[Any, dict[str, torch.Tensor]] | None = None
        """(the batch, its reward sums) of the last DPO training_loss, for training_sums."""

    def _tokenizer(self) -> Any:
        if self.builtin:
            from skylift.recipes.tiny_lm import tiny_tokenizer

            _transformers()  # offline, and the install hint when transformers is missing
            return tiny_tokenizer()
        tokenizer = _transformers().AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        if tokenizer.eos_token_id is None:
            raise SkyliftConfigError(f"recipe.model_path: the tokenizer in {self.folder} has no end-of-sequence "
                                     "token, which ends every document", hint="Set tokenizer.eos_token and "
                                     "save_pretrained the folder again")  # fmt: skip
        return tokenizer

    def _pad_id(self) -> int:
        # Llama 3's tokenizer has no padding token. A padded position's label is -100 and its
        # attention mask 0, so the id there is never seen: end-of-sequence serves.
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def model_config(self) -> Any:
        """The model's ``PretrainedConfig`` (the folder's ``config.json``), for building it."""
        if self.builtin:
            from skylift.recipes.tiny_lm import tiny_llama_config

            return tiny_llama_config(self.tokenizer)
        return _transformers().AutoConfig.from_pretrained(str(self.folder), local_files_only=True)

    def build_datasets(self) -> DatasetSplit:
        settings = self.settings
        if is_table_source(settings.train_path):
            from skylift.recipes.causal_lm_tables import table_datasets

            return table_datasets(self)
        read: Any = read_preference_rows if self.dpo is not None else read_jsonl_documents
        rows = read(Path(settings.train_path), "recipe.train_path")
        if settings.val_path is not None:
            train_rows, val_rows = rows, read(Path(settings.val_path), "recipe.val_path")
        else:
            train_rows, val_rows = self._hold_out(rows)
        train = self._sequences(train_rows, "recipe.train_path")
        val = self._sequences(val_rows, "recipe.val_path (or the held-out data.val_fraction)")
        if isinstance(val, DocumentSequences):
            # Evaluation sums over every sequence, in any order: by length, its batches pad little.
            documents = val
            val = documents.subset(sorted(range(len(documents)), key=lambda index: documents.lengths[index]))
        self._log_data(train_rows, val_rows, train, val)
        return DatasetSplit(train=train, val=val, num_classes=0, in_channels=0)

    def _hold_out(self, rows: list[Any]) -> tuple[list[Any], list[Any]]:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(self.config.seed)).tolist()
        num_val = max(1, round(len(rows) * self.config.data.val_fraction))
        if num_val >= len(rows):
            raise SkyliftConfigError(f"recipe.train_path: {len(rows)} documents leave none for training after "
                                     f"data.val_fraction ({self.config.data.val_fraction})",
                                     hint="Give more documents, or recipe.val_path")  # fmt: skip
        return [rows[i] for i in sorted(order[num_val:])], [rows[i] for i in sorted(order[:num_val])]

    def _sequences(self, rows: list[Any], field: str) -> Sequences:
        if self.dpo is not None:
            return PreferencePairs(encode_preferences(rows, self.tokenizer, field), self.settings.sequence_length)
        documents = self._documents(rows, field)
        if self.settings.packing and self.settings.packing_across_documents:
            return PackedBlocks(documents, self.settings.sequence_length, field=field)
        if self.settings.packing:
            return PackedDocuments(documents, self.settings.sequence_length, field=field)
        return DocumentSequences(documents, self.settings.sequence_length)

    def _documents(self, rows: list[Any], field: str) -> list[EncodedDocument]:
        def encode(texts: list[str], special: bool) -> list[list[int]]:
            return self.tokenizer(texts, add_special_tokens=special)["input_ids"] if texts else []

        mask_prompt = self.settings.mask_prompt
        chats = [row for row in rows if isinstance(row, Conversation)]
        if chats:  # a file holds chats only, or none (read_jsonl_documents)
            documents = encode_conversations(chats, self.tokenizer, field, mask_prompt=mask_prompt)
        else:
            texts = [row for row in rows if not isinstance(row, Conversation)]
            documents = encode_documents(texts, encode, int(self.tokenizer.eos_token_id), mask_prompt=mask_prompt)
        return documents

    def _log_data(self, train_rows: list, val_rows: list, train: Any, val: Any) -> None:
        if isinstance(train, PreferencePairs):
            log.info("causal_lm: DPO on %d training and %d validation pairs (up to %d tokens a sequence; %d "
                     "sequences cut there, %d pairs left out with no completion token left)", len(train), len(val),
                     self.settings.sequence_length, train.truncated, train.dropped)  # fmt: skip
            return
        labelled = int((train.labels != IGNORE_INDEX).sum()) if isinstance(train, PackedBlocks) else sum(
            int((sequence[1] != IGNORE_INDEX).sum()) for sequence in train.sequences)  # fmt: skip
        length = self.settings.sequence_length
        if isinstance(train, PackedBlocks):
            shape = f"{len(train)} packed blocks of {length} tokens, attention across documents"
        elif isinstance(train, PackedDocuments):
            filled = sum(train.lengths) / (len(train) * length)
            shape = (f"{len(train)} packed sequences of up to {length} tokens ({filled:.1%} filled; "
                     f"{train.split_documents} documents split into pieces there)")
        else:
            shape = f"{len(train)} sequences (up to {length} tokens; {train.truncated} cut there)"
        log.info("causal_lm: %d training and %d validation documents; training: %s, %d labelled tokens; "
                 "validation: %d sequences", len(train_rows), len(val_rows), shape, labelled, len(val))  # fmt: skip

    def build_model(self, data: DatasetSplit | None = None) -> nn.Module:
        """The model in fp32: the folder's weights, or the tiny Llama drawn from the run's
        seed; with ``recipe.lora``, frozen under PEFT's adapters, its state dict the
        adapters' only (:mod:`skylift.recipes.adapters`). Under a meta default device
        (``with torch.device("meta")``: a memory estimate, or a sharded run that loads
        :meth:`weights_source` itself), the architecture only."""
        from skylift.recipes.adapters import apply_lora, check_quantization

        check_quantization(self.settings.lora, self._device_type())
        model = self._base_model()
        if self.settings.packing and not self.settings.packing_across_documents and self.dpo is None:
            check_packed_attention(model)
        if self.settings.lora is None:
            if self.reference is not None:
                self.reference.keep_copy(model)
            return model
        return apply_lora(model, self.settings.lora, self.config.seed)

    def frozen_reference(self) -> nn.Module | None:
        """DPO's frozen copy of the starting model (``recipe.dpo.reference: frozen_copy``),
        for the trainer to shard as it shards the policy; None otherwise."""
        return self.reference.copy if self.reference is not None else None

    def reference_fingerprint(self, precision: str) -> str | None:
        """With ``recipe.dpo.precompute_reference``, the fingerprint of the table of reference
        log-probabilities this run needs (:meth:`use_reference_table` then takes it); None
        without."""
        if self.dpo is None or not self.dpo.precompute_reference:
            return None
        return reference_fingerprint(model_path=self.settings.model_path, folder=self.folder, seed=self.config.seed,
                                     sequence_length=self.settings.sequence_length, precision=precision,
                                     kind=str(self.dpo.reference))  # fmt: skip

    @torch.no_grad()
    def reference_log_probs(self, model: nn.Module, batch: Any) -> tuple[list[bytes], torch.Tensor, torch.Tensor]:
        """Each pair's key and its chosen and rejected reference log-probabilities, from the
        model as built (the starting model), for the precomputed table."""
        assert self.reference is not None
        input_ids, attention_mask, labels = (tensor.transpose(0, 1).flatten(0, 1) for tensor in batch)
        values = self.reference.log_probs(model, input_ids, attention_mask, labels)
        pairs = len(batch[0])
        return pair_keys(batch), values[:pairs], values[pairs:]

    def use_reference_table(self, table: ReferenceTable) -> None:
        assert self.reference is not None
        self.reference_table = table
        self.reference.retire()

    def _device_type(self) -> str:
        device = self.config.device
        return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"

    def _base_model(self) -> nn.Module:
        transformers = _transformers()
        if torch.get_default_device().type == "meta":
            return transformers.AutoModelForCausalLM.from_config(self.model_config(), dtype=torch.float32)
        from skylift.recipes.tiny_lm import tiny_llama

        lora = self.settings.lora
        if lora is not None and lora.quantize_base is not None:  # QLoRA
            from skylift.recipes.adapters import load_quantized

            return load_quantized(self.folder, lambda: tiny_llama(self.tokenizer, self.config.seed), lora,
                                  self._device_type(), self.config.precision)  # fmt: skip
        if self.builtin:
            model = tiny_llama(self.tokenizer, self.config.seed)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(self.folder), dtype=torch.float32,
                                                                      local_files_only=True)  # fmt: skip
        rows = model.get_input_embeddings().num_embeddings
        if len(self.tokenizer) > rows:
            raise SkyliftConfigError(f"recipe.model_path: the tokenizer numbers {len(self.tokenizer)} tokens, the "
                                     f"model embeds {rows}", hint="Use the tokenizer saved with this model, or resize "
                                     "its embeddings and save_pretrained it again")  # fmt: skip
        return model

    def weights_source(self) -> Path | None:
        """The model folder, when it holds safetensors weights (the tiny Llama has none).
        With adapters, the base's tensors load from it under PEFT's names
        (:meth:`weights_name`) and the adapters are drawn once it is loaded."""
        if self.folder is None or not any(self.folder.glob("*.safetensors")):
            return None
        return self.folder

    def weights_name(self, name: str) -> str | None:
        if self.settings.lora is None:
            return name
        from skylift.recipes.adapters import base_weight_name

        return base_weight_name(name)

    def initialise_unloaded(self, model: nn.Module) -> None:
        if self.settings.lora is not None:
            from skylift.recipes.adapters import initialise_adapters

            initialise_adapters(model, self.config.seed)

    def collate(self, train: bool) -> Any:
        if self.dpo is not None:
            return preference_collate(self.pad_id)
        if self.settings.packing and not self.settings.packing_across_documents:
            return packed_collate(self.pad_id)
        return causal_collate(self.pad_id)

    def _dpo_forward(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, ...]:
        """Per pair of ``batch`` (``(B, 2, T)`` tensors): DPO's loss and the two rewards."""
        assert self.dpo is not None and self.reference is not None
        # The 2B sequences chosen first, then rejected (TRL's concatenated layout), in one forward.
        input_ids, attention_mask, labels = (tensor.transpose(0, 1).flatten(0, 1) for tensor in batch)
        policy = sequence_log_probs(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
        if self.reference_table is not None:
            reference = self.reference_table.lookup(batch)
        else:
            reference = self.reference.log_probs(model, input_ids, attention_mask, labels)
        pairs = len(batch[0])
        return dpo_losses(policy[:pairs], policy[pairs:], reference[:pairs], reference[pairs:], beta=self.dpo.beta,
                          label_smoothing=self.dpo.label_smoothing)  # fmt: skip

    def logits(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The model's logits on a collated batch: padded documents, or packed ones."""
        if isinstance(batch, dict):  # packed documents (packed_collate)
            # No attention mask and no cache: only then does transformers read the packed
            # documents from the position ids and build the block-diagonal causal mask.
            return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        input_ids, attention_mask, _ = batch
        return model(input_ids=input_ids, attention_mask=attention_mask).logits

    def _forward(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        labels = batch["labels"] if isinstance(batch, dict) else batch[2]
        return token_loss_sums(self.logits(model, batch), labels)

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Mean cross-entropy over the batch's labelled tokens (0 when it has none); with DPO,
        the mean loss over the batch's pairs."""
        if self.dpo is not None:
            losses, chosen, rejected = self._dpo_forward(model, batch)
            self._step_sums = (batch, pair_sums(losses, chosen, rejected))
            return losses.mean()
        loss_sum, count = self._forward(model, batch)
        return loss_sum / count.clamp(min=1)

    def loss_count(self, batch: Any) -> torch.Tensor:
        """The batch's labelled tokens: prompt and padding positions do not count; with DPO,
        its pairs (a pair's loss is one term, however long its completions)."""
        if self.dpo is not None:
            return torch.tensor(len(batch[0]), device=batch[0].device)
        labels = batch["labels"] if isinstance(batch, dict) else batch[2]
        return (labels != IGNORE_INDEX).sum()

    def training_sums(self, batch: Any) -> dict[str, torch.Tensor] | None:
        """With DPO, the reward sums of ``batch`` that :meth:`training_loss` just computed."""
        if self._step_sums is None or self._step_sums[0] is not batch:
            return None
        sums = dict(self._step_sums[1])
        sums.pop("loss_sum")
        return sums

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        if self.dpo is not None:
            return {key: value.float() for key, value in pair_sums(*self._dpo_forward(model, batch)).items()}
        loss_sum, count = self._forward(model, batch)
        return {"loss_sum": loss_sum.float(), "count": count.float()}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """``loss`` per labelled token and ``perplexity``, its exponential; with DPO, the
        loss and the rewards per pair (:data:`~skylift.recipes.preference.REWARD_SCALARS`)."""
        if self.dpo is not None:
            pairs = max(sums.get("count", 0.0), 1.0)
            return {"loss": sums.get("loss_sum", 0.0) / pairs,
                    **{name: sums.get(f"{name}_sum", 0.0) / pairs for name in REWARD_SCALARS}}  # fmt: skip
        loss = sums.get("loss_sum", 0.0) / max(sums.get("count", 0.0), 1.0)
        # exp overflows a float past 709.78; a loss that high means perplexity is meaningless anyway.
        return {"loss": loss, "perplexity": math.exp(loss) if loss < 709.0 else math.inf}

    def export_pretrained(self, state_dict: dict[str, torch.Tensor], out_dir: Path, *,
                          dtype: torch.dtype = torch.float32, merged: bool = False) -> list[Path]:
        """The model of :meth:`model_config` holding ``state_dict``, and the tokenizer, as
        ``save_pretrained`` writes them (safetensors), in ``dtype``. With ``recipe.lora``,
        ``state_dict`` holds the adapters: PEFT's adapter folder (``adapter_config.json``,
        ``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, folder)`` loads
        it), or with ``merged`` the base with the adapters merged in (``merge_and_unload``).

        Raises:
            SkyliftConfigError: ``state_dict`` does not fit the architecture (names the keys).
        """
        if self.settings.lora is not None:
            return self._export_adapters(state_dict, out_dir, dtype=dtype, merged=merged)
        if merged:
            raise SkyliftConfigError("--merged: this run trained every weight (recipe.lora is null), so there are "
                                     "no adapters to merge", hint="Export without --merged: the folder is the "
                                     "whole model already")  # fmt: skip
        transformers = _transformers()
        with torch.device("meta"):  # no memory for weights that are replaced next
            model = transformers.AutoModelForCausalLM.from_config(self.model_config(), dtype=torch.float32)
        buffers = {name for name, _ in model.named_buffers()}
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        missing = [name for name in missing if name not in tied and name not in buffers]
        if missing or unexpected:
            raise SkyliftConfigError(
                f"the checkpoint does not fit {type(model).__name__} of {self.settings.model_path}: missing "
                f"{missing[:5]}, unexpected {list(unexpected)[:5]}", hint="Export with the config the run trained")
        model.tie_weights()
        model.to(dtype)
        return self._save_pretrained(model, out_dir)

    def _export_adapters(self, state_dict: dict[str, torch.Tensor], out_dir: Path, *, dtype: torch.dtype,
                         merged: bool) -> list[Path]:
        """The base built as the run built it, the trained adapters loaded over it; a 4-bit
        base (QLoRA) is built in full precision instead, which the adapters merge into
        (PEFT's advice) and the adapter folder does not depend on."""
        lora = self.settings.lora
        assert lora is not None
        self.settings.lora = lora.model_copy(update={"quantize_base": None})
        try:
            model = self.build_model()
        finally:
            self.settings.lora = lora
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise SkyliftConfigError(
                f"the checkpoint does not fit {self.settings.model_path} with recipe.lora {self.settings.lora}: "
                f"missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}",
                hint="Export with the config the run trained (a full fine-tune's weights hold no adapters)")
        if merged:
            model = cast(Any, model).merge_and_unload()  # a PeftModel's
        model.to(dtype)
        return self._save_pretrained(model, out_dir)

    def _save_pretrained(self, model: nn.Module, out_dir: Path) -> list[Path]:
        transformers = _transformers()
        transformers.logging.disable_progress_bar()  # one "Writing model shards" bar per call otherwise
        try:
            cast(Any, model).save_pretrained(str(out_dir))  # a Hugging Face (or PEFT) model's
        finally:
            transformers.logging.enable_progress_bar()
        self.tokenizer.save_pretrained(str(out_dir))
        return sorted(path for path in out_dir.iterdir() if path.is_file())


PACKED_ATTENTION = ("sdpa", "eager", "flex_attention")
"""The attention implementations that keep packed documents apart: transformers'
``create_causal_mask`` turns per-document position ids into a block-diagonal mask for
them. Flash attention is not among them: transformers 5's flash path ignores that mask
and reads packed position ids only for a batch of one row (``_is_packed_sequence``), so
a micro-batch of several packed rows would attend across documents."""


def check_packed_attention(model: nn.Module) -> None:
    """Refuse a model that would let packed documents attend to each other: one whose
    attention implementation is not in :data:`PACKED_ATTENTION` (a custom kernel gets no
    mask from transformers, so every position would see the whole sequence's past), or
    whose modelling code does not build its mask with transformers' ``create_causal_mask``
    (older or remote code, which ignores packed position ids).

    Raises:
        SkyliftConfigError: naming recipe.packing, the model's class and its attention.
    """
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    module = sys.modules.get(type(getattr(model, "base_model", model)).__module__)
    reads_positions = module is not None and hasattr(module, "create_causal_mask")
    if attention in PACKED_ATTENTION and reads_positions:
        return
    why = (f"its attention implementation is {attention!r}, which gets no block-diagonal mask from transformers"
           if attention not in PACKED_ATTENTION else
           "its modelling code does not build its mask with transformers' create_causal_mask")  # fmt: skip
    raise SkyliftConfigError(
        f"recipe.packing: {type(model).__name__} cannot keep packed documents apart: {why}, so each document "
        "would attend to the ones before it in its sequence", hint="Set recipe.packing: false (one document a "
        f"sequence, padded), or load the model with attn_implementation one of {', '.join(PACKED_ATTENTION)}")


def _model_folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise SkyliftConfigError(
            f"recipe.model_path: {folder} holds no config.json, so it is not a Hugging Face model folder",
            hint=f"Point it at a folder that save_pretrained wrote (config.json, *.safetensors, tokenizer files), "
            f"or use {TINY_LLAMA}")  # fmt: skip
    return folder


def _transformers() -> Any:
    offline()
    try:
        import transformers
    except ImportError:
        raise SkyliftConfigError("recipe causal_lm needs the transformers package", hint=_INSTALL_HINT) from None
    return transformers

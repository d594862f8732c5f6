"""``causal_lm``'s settings (torch-free)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from skylift.config.section import Section
from skylift.data.table_rows import is_table_source
from skylift.errors import SkyliftConfigError
from skylift.recipes.settings.base import RecipeSettings

__all__ = ["TINY_LLAMA", "CausalLMSettings", "DpoSettings", "LoraSettings"]

TINY_LLAMA = "builtin:tiny-llama"
"""``recipe.model_path`` of the built-in tiny Llama (:mod:`skylift.recipes.tiny_lm`)."""


class LoraSettings(Section):
    """``recipe.lora``: low-rank adapters (LoRA, Hu et al. 2021) through PEFT's
    ``get_peft_model``; the base model's weights stay frozen."""

    rank: int = Field(default=16, ge=1, le=4096)
    """The rank r of each adapter: a targeted layer of shape (out, in) gains r x (in + out)
    trainable parameters."""
    alpha: float = Field(default=32.0, gt=0)
    """The adapter's output is scaled by alpha / rank (PEFT's ``lora_alpha``)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training (PEFT's ``lora_dropout``)."""
    target_modules: list[str] | None = None
    """Names of the linear layers that get adapters (a layer matches when its dotted name
    is the name or ends with ``.NAME``, as in PEFT). ``null``: every linear layer except
    the output head, by the names the model uses (Llama: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj). A name that matches no layer is an error listing the
    model's linear layers."""
    modules_to_save: list[str] | None = None
    """Layers trained whole beside the adapters (PEFT's ``modules_to_save``), e.g.
    ``[lm_head]`` for a model whose output head must learn too (the tiny Llama starts from
    random weights); they are checkpointed and exported with the adapters. ``null``: none."""
    quantize_base: Literal["nf4"] | None = None
    """QLoRA (Dettmers et al. 2023): the frozen base's linear layers in 4-bit NF4 (0.5625
    bytes a weight with its scales), through transformers' ``BitsAndBytesConfig`` and
    bitsandbytes (the llm extra), computing in the run's precision (bf16 on a GPU that has
    it); the output head and embeddings stay as they are. bitsandbytes runs it on CUDA and on the
    CPU; another device is refused before the run starts."""

    def check_run(self, config: Any) -> None:
        """A 4-bit base sharded by FSDP, or on a device bitsandbytes has no 4-bit kernels for,
        is refused here (``skylift check``); ``device: auto`` is resolved by ``skylift
        run``'s preflight (:meth:`check_device`)."""
        if self.quantize_base is not None and config.distributed.strategy == "fsdp":
            raise SkyliftConfigError(QUANTIZE_UNDER_FSDP, hint=QUANTIZE_UNDER_FSDP_HINT)
        if config.device not in ("auto", "cuda", "cpu"):
            self.check_device(str(config.device).split(":")[0])

    def check_device(self, device_type: str) -> None:
        """Refuse a 4-bit base on a device bitsandbytes' NF4 does not run on (``device_type``:
        ``cuda``, ``cpu``, ``mps``, ...)."""
        if self.quantize_base is not None and device_type not in QUANTIZE_DEVICES:
            raise SkyliftConfigError(QUANTIZE_ON_DEVICE.format(device=device_type), hint=QUANTIZE_HINT)


QUANTIZE_DEVICES = ("cuda", "cpu")
"""Where bitsandbytes 0.50's 4-bit NF4 layers run, forward and backward (measured on both)."""
QUANTIZE_ON_DEVICE = ("recipe.lora.quantize_base: nf4 keeps the frozen base in bitsandbytes' 4-bit NF4, which runs "
                      "on CUDA and the CPU, and this run trains on {device}")
QUANTIZE_UNDER_FSDP = (
    "recipe.lora.quantize_base: nf4 with distributed.strategy: fsdp is not built: FSDP2 shards and all-gathers "
    "each parameter as a plain tensor, and bitsandbytes' packed 4-bit weights keep their per-block scales "
    "(quant_state) outside it; the fix is a 4-bit weight type implementing FSDP2's all-gather extension "
    "(fsdp_pre_all_gather / fsdp_post_all_gather) that carries its scales")
QUANTIZE_UNDER_FSDP_HINT = ("Set distributed.strategy: ddp with the 4-bit base, or remove recipe.lora.quantize_base "
                            "to shard the full-precision base under FSDP")
QUANTIZE_HINT = ("Set device: cuda or cpu, or remove recipe.lora.quantize_base to train LoRA over the "
                 "full-precision base")


class DpoSettings(Section):
    """``recipe.dpo``: Direct Preference Optimization (Rafailov et al. 2023), the sigmoid
    loss of TRL's ``DPOTrainer`` (``loss_type: sigmoid``), with ``recipe.objective: dpo``."""

    beta: float = Field(default=0.1, gt=0)
    """How far the policy may move from the reference: the loss of a pair is
    ``-log sigmoid(beta * ((policy - reference log-prob of chosen) - (policy - reference
    log-prob of rejected)))``, and ``beta`` times each log-ratio is the reward logged (TRL's
    default 0.1)."""
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    """Conservative DPO (cDPO, Mitchell 2023): the probability that a pair's preference
    is flipped; the loss becomes ``(1 - s) * -log sigmoid(beta d) + s * -log sigmoid(-beta d)``.
    0 is plain DPO. (TRL 1.16's ``sigmoid`` loss has no smoothing term; its ``robust`` and
    ``exo_pair`` losses use the field otherwise.)"""
    reference: Literal["base_without_adapters", "frozen_copy"] | None = None
    """Where the reference log-probabilities come from: ``base_without_adapters`` (with
    ``recipe.lora``: the same model with its adapters switched off, PEFT's
    ``disable_adapter``; no memory added), or ``frozen_copy`` (a full fine-tune: a frozen
    copy of the starting model, one more copy of the weights in memory). ``null``: the one
    that fits ``recipe.lora``; the other is refused."""
    precompute_reference: bool = False
    """Compute the reference log-probabilities once, before the first step, for every
    training and validation pair (TRL's ``precompute_ref_log_probs``), and store them at
    ``checkpoint.root``'s ``reference/``: each step then runs no reference forward (about a
    quarter of a DPO step's arithmetic), and ``frozen_copy`` keeps no copy of the weights.
    The pass costs one forward of every pair, read once more from its source; a resume
    reads the stored table (or computes it again from the model as built, which is the
    starting model)."""


class CausalLMSettings(RecipeSettings):
    """``recipe`` of ``causal_lm``: a Hugging Face causal language model fine-tuned on JSONL
    documents, or on Parquet and Hugging Face datasets read where they live."""

    model_path: str = Field(min_length=1)
    """The model and tokenizer: a local Hugging Face folder that ``save_pretrained`` wrote
    (``config.json``, safetensors weights, tokenizer files) for ``AutoModelForCausalLM``
    and ``AutoTokenizer``, read offline and never downloaded; or ``builtin:tiny-llama``,
    a 2-layer Llama of 0.15 M parameters initialised from the run's seed, with a
    byte-level BPE tokenizer trained on skylift's generated corpus (the CPU preset's
    model: it trains from scratch, in seconds)."""
    train_path: str = Field(min_length=1)
    """The training documents: a JSONL file whose rows hold ``text`` (every token
    learned) or ``prompt`` and ``completion`` (only the completion's tokens learned); or
    whose rows are chats, ``messages``: a list of ``{"role": "system" | "user" |
    "assistant", "content": ...}``, rendered by the tokenizer's own chat template, only
    the assistant turns' tokens learned. A file holds chats or the other rows, not both.
    Or a table source with those columns, read where it lives and fetched a row group at
    a time as training needs it: a ``.parquet`` file, a folder of them (a Hugging Face
    dataset's Parquet shards; ``data/train-*.parquet`` picks some), or a local folder
    that ``datasets``' ``save_to_disk`` wrote, locally or at an ``s3://``, ``oss://``,
    ``cos://`` URL (endpoint: ``data.endpoint_url``); its rows are shuffled in blocks of
    ``data.shuffle_block_shards`` row groups, ``data.prefetch_shards`` fetched ahead,
    one document per sequence (``packing: false``)."""
    val_path: str | None = None
    """Validation documents in the same form; ``null`` holds out ``data.val_fraction`` of
    the training documents (a seeded draw; of a table source, whole row groups)."""
    sequence_length: int = Field(default=2048, ge=8, le=1_048_576)
    """Tokens per training sequence: the length of each packed block, or, unpacked, the
    longest document kept (longer ones are cut there; the run logs how many)."""
    packing: bool = True
    """Place several documents in each sequence of up to ``sequence_length`` tokens, each
    attending only to itself: position ids restart at 0 per document and the model's
    attention gets the block-diagonal causal mask from them (transformers' sdpa, eager or
    flex attention; another, flash attention included, is refused when the model is built). No token is
    predicted from another document. A document longer than ``sequence_length`` is split
    into pieces of that many tokens, each its own document. ``false``: one document per
    sequence, cut at ``sequence_length``, padded per batch; needed with ``data.batching:
    token_budget``."""
    packing_across_documents: bool = False
    """With ``packing``: concatenate the documents and cut the stream into blocks of
    ``sequence_length`` instead (HF ``run_clm.py``'s ``group_texts``): no padding, but
    attention and next-token prediction cross the documents inside a block. For a corpus
    whose rows are consecutive pieces of longer texts; wrong for independent documents."""
    mask_prompt: bool = True
    """Leave a ``prompt``'s tokens out of the loss (labels -100), so only the completion is
    learned, and of a chat every token but the assistant turns'; ``false`` learns the
    prompt, and every token of a chat (its system and user turns, the template's headers), too."""

    objective: Literal["sft", "dpo"] = "sft"
    """What the run learns: ``sft``, next-token cross-entropy on the documents (the
    targets above); ``dpo``, preferences: rows of ``prompt`` (or ``messages``, a chat that
    the answer continues) with a ``chosen`` and a ``rejected`` completion, learned with
    the DPO loss of ``recipe.dpo`` (needs ``packing: false``)."""
    dpo: DpoSettings | None = None
    """The DPO loss's settings, with ``objective: dpo`` (``null`` there: the defaults)."""

    lora: LoraSettings | None = None
    """Train low-rank adapters on the frozen model instead of every weight (PEFT):
    checkpoints then hold the adapters and their optimizer state only, and ``skylift
    export`` writes a PEFT adapter folder (``--merged``: the model with them merged in).
    ``null``: full fine-tuning."""

    def check_device(self, device_type: str) -> None:
        """What the device the run resolved to cannot do (``skylift run``'s preflight asks,
        before any worker starts): a 4-bit base off CUDA."""
        if self.lora is not None:
            self.lora.check_device(device_type)

    def check_run(self, config: Any) -> None:
        """JSONL files or table sources, not streamed shards; a table source unpacked, in fixed
        batches, for SFT; token-budget batching of unpacked documents that fit it."""
        data = config.data
        if self.objective == "dpo":
            self._check_dpo(config)
        elif self.dpo is not None:
            raise SkyliftConfigError("recipe.dpo is set while recipe.objective is sft, so it would be ignored",
                                     hint="Set recipe.objective: dpo, or remove recipe.dpo")  # fmt: skip
        if self.lora is not None:
            self.lora.check_run(config)
        if is_table_source(self.train_path):
            self._check_table_source(config)
        if data.url or data.val_url:
            raise SkyliftConfigError("data.url: causal_lm reads JSONL files (recipe.train_path, val_path), not "
                                     "streamed shards", hint="Remove data.url and data.val_url")  # fmt: skip
        if self.packing_across_documents and not self.packing:
            raise SkyliftConfigError("recipe.packing_across_documents: true needs recipe.packing: true",
                                     hint="Set recipe.packing: true, or remove recipe.packing_across_documents")
        if data.batching == "token_budget" and self.packing:
            raise SkyliftConfigError(
                "recipe.packing: packed sequences are filled up to recipe.sequence_length tokens already, so "
                "data.batching: token_budget has nothing to sort", hint="Set recipe.packing: false, or "
                "data.batching: fixed")  # fmt: skip
        if data.batching == "token_budget" and self.sequence_length > data.max_tokens:
            raise SkyliftConfigError(
                f"recipe.sequence_length ({self.sequence_length}) exceeds data.max_tokens ({data.max_tokens}): "
                "the longest document would not fit a micro-batch", hint="Raise data.max_tokens or lower "
                "recipe.sequence_length")  # fmt: skip

    def _check_table_source(self, config: Any) -> None:
        """A table source streams one document per sequence, with fixed global batches."""
        if self.packing:
            raise SkyliftConfigError(
                f"recipe.packing: recipe.train_path {self.train_path} is read a row group at a time as training "
                "needs it, and packing would need every document's tokens before the first step",
                hint="Set recipe.packing: false (one document per sequence, padded per batch)")  # fmt: skip
        if config.data.batching == "token_budget":
            raise SkyliftConfigError("data.batching: token_budget sorts every document by length before the first "
                                     f"step, and recipe.train_path {self.train_path} is read as training needs it",
                                     hint="Set data.batching: fixed")  # fmt: skip

    def _check_dpo(self, config: Any) -> None:
        """What DPO cannot run with: packing, an unmasked prompt, a token budget under a pair, FSDP, and a
        reference that does not fit ``recipe.lora``."""
        if self.dpo is None:
            self.dpo = DpoSettings()
        if self.packing:
            raise SkyliftConfigError(
                "recipe.packing: DPO scores each chosen and rejected completion as a whole sequence, which packing "
                "would cut and mix with other documents", hint="Set recipe.packing: false with recipe.objective: dpo")
        if not self.mask_prompt:
            raise SkyliftConfigError(
                "recipe.mask_prompt: false learns the prompt, and DPO scores the completions only",
                hint="Set recipe.mask_prompt: true (the default) with recipe.objective: dpo")  # fmt: skip
        if config.data.batching == "token_budget" and 2 * self.sequence_length > config.data.max_tokens:
            raise SkyliftConfigError(
                f"data.max_tokens ({config.data.max_tokens}) is under two recipe.sequence_length "
                f"({2 * self.sequence_length}): a DPO pair is two sequences, batched whole",
                hint=f"Raise data.max_tokens to {2 * self.sequence_length} or more, or lower recipe.sequence_length")
        wanted: Literal["base_without_adapters", "frozen_copy"] = (
            "base_without_adapters" if self.lora is not None else "frozen_copy")
        if self.dpo.reference is None:
            self.dpo.reference = wanted
        elif self.dpo.reference != wanted:
            raise SkyliftConfigError(REFERENCE_MISMATCH[wanted], hint=REFERENCE_HINT[wanted])


REFERENCE_MISMATCH = {
    "base_without_adapters": "recipe.dpo.reference: frozen_copy with recipe.lora would hold a second copy of the "
                             "base, and the base with its adapters switched off is that model already (PEFT starts "
                             "the adapters at zero)",
    "frozen_copy": "recipe.dpo.reference: base_without_adapters needs adapters to switch off, and recipe.lora is null "
                   "(every weight trains)",
}  # fmt: skip
REFERENCE_HINT = {
    "base_without_adapters": "Set recipe.dpo.reference: base_without_adapters (or null)",
    "frozen_copy": "Set recipe.dpo.reference: frozen_copy (or null), or train adapters with recipe.lora",
}

"""DPO's reference log-probabilities computed once (``recipe.dpo.precompute_reference``).

The reference is the starting model, so its log-probability of a completion never
changes during training: computing it at every step (TRL's default) spends a forward
of both sequences of every pair without gradient, about a quarter of a DPO step's
arithmetic (the policy's forward and backward are about three forwards), and a full
fine-tune keeps a frozen copy of every weight for it. Computed once before the first
step instead (TRL's ``precompute_ref_log_probs``), over every training and validation
pair, each step looks its pairs' values up.

A pair is looked up by the digest of its tokens and labels (:func:`pair_keys`), not by
its index, so the table holds for any order, micro-batch, rank count or source (an
in-memory set or a stream of table rows) and a batch's padding does not change a key.
The table is a safetensors file (no pickle): the keys as ``(N, 16)`` bytes, the values
as ``(N, 2)`` fp32, chosen then rejected, and the fingerprint of what they were computed
from (:func:`reference_fingerprint`) in its metadata.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

__all__ = ["KEY_BYTES", "ReferenceTable", "pair_keys", "reference_fingerprint"]

KEY_BYTES = 16
"""A pair's key: 128 bits of BLAKE2b, so two different pairs of a dataset share a key
with a probability far below a bit flip's in memory."""


def pair_keys(batch: Sequence[torch.Tensor]) -> list[bytes]:
    """The key of each pair of a collated batch (``(input_ids, attention_mask, labels)``,
    each ``(B, 2, T)``): the digest of both sequences' tokens and labels, padding cut off."""
    input_ids, attention_mask, labels = (tensor.detach().cpu() for tensor in batch)
    lengths = attention_mask.sum(dim=2).tolist()
    keys = []
    for pair, (chosen_length, rejected_length) in enumerate(lengths):
        digest = hashlib.blake2b(digest_size=KEY_BYTES)
        for side, length in ((0, chosen_length), (1, rejected_length)):
            digest.update(int(length).to_bytes(8, "little"))
            digest.update(input_ids[pair, side, :length].numpy().tobytes())
            digest.update(labels[pair, side, :length].numpy().tobytes())
        keys.append(digest.digest())
    return keys


def reference_fingerprint(*, model_path: str, folder: Path | None, seed: int, sequence_length: int,
                          precision: str, kind: str) -> str:
    """What the values depend on besides the pairs themselves: the model (a folder's
    weights, :func:`~skylift.recipes.base_weights.weights_fingerprint`; the built-in
    model's seed), the precision they were computed in and the reference's kind. A stored
    table of another fingerprint is computed again."""
    from skylift.recipes.base_weights import weights_fingerprint

    digest = hashlib.blake2b(digest_size=KEY_BYTES)
    parts: list[str] = [model_path, str(sequence_length), precision, kind]
    parts.append(f"seed={seed}" if folder is None else weights_fingerprint(folder))
    digest.update("\n".join(parts).encode())
    return digest.hexdigest()


class ReferenceTable:
    """Pair key -> (chosen, rejected) reference log-probabilities, fp32."""

    def __init__(self, fingerprint: str, values: dict[bytes, tuple[float, float]] | None = None) -> None:
        self.fingerprint = fingerprint
        self.values: dict[bytes, tuple[float, float]] = dict(values or {})

    def __len__(self) -> int:
        return len(self.values)

    def add(self, keys: Iterable[bytes], chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        for key, chosen_value, rejected_value in zip(keys, chosen.tolist(), rejected.tolist(), strict=True):
            self.values[key] = (chosen_value, rejected_value)

    def missing(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys`` the table lacks."""
        return sum(key not in self.values for key in keys)

    def lookup(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """The reference log-probabilities of a collated batch's ``2B`` sequences, chosen
        first then rejected (the policy's layout), on the batch's device, fp32.

        Raises:
            KeyError: a pair the table was not computed for (the data changed under a run).
        """
        keys = pair_keys(batch)
        try:
            rows = [self.values[key] for key in keys]
        except KeyError:
            raise KeyError(f"{self.missing(keys)} of the batch's {len(keys)} pairs have no precomputed reference "
                           "log-probability: the pairs differ from those the table was computed for") from None
        table = torch.tensor(rows, dtype=torch.float32)
        return torch.cat([table[:, 0], table[:, 1]]).to(batch[0].device)

    def to_bytes(self) -> bytes:
        keys = sorted(self.values)
        encoded = torch.frombuffer(bytearray(b"".join(keys)), dtype=torch.uint8).view(len(keys), KEY_BYTES) \
            if keys else torch.zeros((0, KEY_BYTES), dtype=torch.uint8)  # fmt: skip
        values = torch.tensor([self.values[key] for key in keys], dtype=torch.float32).view(len(keys), 2)
        return save_safetensors({"keys": encoded, "log_probs": values}, metadata={"fingerprint": self.fingerprint})

    @classmethod
    def from_bytes(cls, data: bytes, fingerprint: str) -> ReferenceTable | None:
        """The table ``data`` holds, or None when it was computed for another fingerprint."""
        if _metadata(data).get("fingerprint") != fingerprint:
            return None
        tensors = load_safetensors(data)
        keys = [bytes(row) for row in tensors["keys"].tolist()]
        values = [tuple(row) for row in tensors["log_probs"].tolist()]
        return cls(fingerprint, {key: (value[0], value[1]) for key, value in zip(keys, values, strict=True)})


def _metadata(data: bytes) -> dict[str, Any]:
    """A safetensors blob's ``__metadata__`` (from its JSON header, before reading the tensors)."""
    header_length = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + header_length]).get("__metadata__") or {})

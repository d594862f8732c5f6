"""The quickstart's recipe, logging the ids of the samples each micro-batch trains on.

Each process appends one line per micro-batch (the ids, space-separated) to a file of its
own in ``SKYLIFT_TEST_SAMPLE_LOG``. Ids are logged where the loss is computed, not where
the loader fetches (it fetches ahead), so a stop at a step boundary logs exactly what
was trained.

``SKYLIFT_TEST_HOLD_ALONE_AFTER=N`` holds a process that is alone in its job (world size
1) in its first micro-batch past the N-th until the SIGTERM that ends it arrives: a node
that must still be training when another joins, however fast the machine trains."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from skylift.recipes.image_classification import ImageClassification

LOG_VARIABLE = "SKYLIFT_TEST_SAMPLE_LOG"
HOLD_VARIABLE = "SKYLIFT_TEST_HOLD_ALONE_AFTER"


class _WithIds(Dataset):
    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        image, label = self.inner[index]
        return image, label, index


class SampleLoggedClassification(ImageClassification):
    _trained = 0  # micro-batches this process has trained

    def build_datasets(self):
        split = super().build_datasets()
        return dataclasses.replace(split, train=_WithIds(split.train))

    def training_loss(self, model, batch):
        images, labels, ids = batch
        loss = super().training_loss(model, (images, labels))
        folder = os.environ.get(LOG_VARIABLE)
        # A loss on the meta device is the monitor's FLOP count of the step, not training.
        if folder and loss.device.type != "meta":
            with (Path(folder) / f"samples-{os.getpid()}.txt").open("a") as log:
                log.write(" ".join(str(int(index)) for index in ids) + "\n")
        if loss.device.type != "meta":
            self._trained += 1
            held_after = os.environ.get(HOLD_VARIABLE)  # unset: never held
            if held_after and self._trained == int(held_after) + 1 and os.environ.get("WORLD_SIZE") == "1":
                _hold_until_terminated()
        return loss


def _hold_until_terminated() -> None:
    """Sleep until SIGTERM; skylift's own handler still runs (it requests the stop), and the
    step then ends as any step a SIGTERM arrives in."""
    terminated = []
    previous = signal.getsignal(signal.SIGTERM)

    def note(signum, frame):
        terminated.append(signum)
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, note)
    try:
        while not terminated:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


def logged_samples(folder: Path) -> list[int]:
    """Every sample id the processes logged, all attempts together."""
    ids: list[int] = []
    for path in sorted(folder.glob("samples-*.txt")):
        for line in path.read_text().splitlines():
            ids += [int(part) for part in line.split()]
    return ids

"""A real Lightning ``Trainer`` job: a small MLP with dropout on generated data.

Importable (the in-process tests) and a script for ``skylift launch``::

    skylift launch --nproc 2 -- python examples/integrations/lightning_job.py CONFIG [PAUSE_AT_STEP]

``PAUSE_AT_STEP`` (script only): rank 0 writes ``RUN_DIR/paused-at`` at that step and
waits for ``RUN_DIR/go`` before skylift's callback sees the step end, so a test can arm
a spot notice at a known step.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from skylift.integrations.lightning import SkyliftCallback, resume_checkpoint

MAX_STEPS = 24
SAMPLES = 256
BATCH = 8


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_index: int) -> torch.Tensor:
        features, labels = batch
        loss = nn.functional.cross_entropy(self.net(features), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(SAMPLES, 8, generator=generator)
    return DataLoader(TensorDataset(features, (features[:, 0] > 0).long()), batch_size=BATCH, shuffle=True)


def trainer(callbacks: list[pl.Callback], *, max_steps: int = MAX_STEPS) -> pl.Trainer:
    """Seed 0, fp32 on the CPU, one process per torchrun worker (DDP over gloo with two)."""
    pl.seed_everything(0, verbose=False)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return pl.Trainer(accelerator="cpu", devices=world_size, strategy="ddp" if world_size > 1 else "auto",
                      max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)


class PauseAt(pl.Callback):
    """Holds rank 0 at the end of ``step`` until the test says go (listed before skylift's callback)."""

    def __init__(self, folder: Path, step: int) -> None:
        self.folder, self.step = folder, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_index):  # noqa: ANN001 - Lightning's
        if trainer.global_step != self.step or trainer.global_rank != 0:
            return
        (self.folder / "paused-at").write_text(str(self.step))
        deadline = time.monotonic() + 120
        while not (self.folder / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def main(argv: list[str]) -> None:
    skylift = SkyliftCallback(argv[0])
    folder = Path(skylift.config.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pause = [PauseAt(folder, int(argv[1]))] if len(argv) > 1 and not (folder / "go").exists() else []
    job = trainer([*pause, skylift])
    job.fit(Classifier(), loader(), ckpt_path=resume_checkpoint(job))


if __name__ == "__main__":
    main(sys.argv[1:])

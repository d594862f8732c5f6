"""An unchanged Lightning script with a ModelCheckpoint of its own (no skylift import).

    lightning_model_checkpoint_job.py MAX_STEPS [HANG_AT_STEP]

``ModelCheckpoint`` writes every 4 steps into ``lightning-checkpoints/``; skylift's own
cadence is its default (every 10 minutes), so it writes nothing in this short job.
``HANG_AT_STEP``: the job writes ``hanging`` at that step and waits to be killed.
Prints ``step=<global step>`` at the end.
"""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

max_steps = int(sys.argv[1])
hang_at = int(sys.argv[2]) if len(sys.argv) > 2 else None


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_index):
        features, labels = batch
        return nn.functional.cross_entropy(self.net(features), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class HangAt(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_index):
        if trainer.global_step == hang_at:
            Path("hanging").write_text(str(hang_at))
            time.sleep(600)


pl.seed_everything(0, verbose=False)
features = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(features, (features[:, 0] > 0).long()), batch_size=8, shuffle=True)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False,
                     callbacks=[ModelCheckpoint(dirpath="lightning-checkpoints", every_n_train_steps=4, save_top_k=-1),
                                HangAt()])
trainer.fit(Classifier(), loader)
print(f"step={trainer.global_step}", flush=True)

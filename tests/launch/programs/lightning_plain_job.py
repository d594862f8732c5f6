"""An unchanged Lightning script (no skylift import).

    lightning_plain_job.py MAX_STEPS

Prints ``callbacks=<number of SkyliftCallbacks> step=<global step>`` at the end.
"""

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        return nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
inputs = torch.randn(64, 4)
loader = DataLoader(TensorDataset(inputs, inputs.sum(1, keepdim=True)), batch_size=8)
trainer = pl.Trainer(max_steps=int(sys.argv[1]), accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regression(), loader)
count = sum(type(callback).__name__ == "SkyliftCallback" for callback in trainer.callbacks)
print(f"callbacks={count} step={trainer.global_step}")

"""A Trainer or Lightning job that leaves the launched processes apart (no skylift import).

    unjoined_job.py hf OUTPUT_DIR          a Trainer on the CPU without use_cpu
    unjoined_job.py lightning              Lightning with devices="auto" on the CPU

Under ``skylift launch --nproc 2`` each process would run the whole job as its own rank 0.
"""

import sys

import torch

if sys.argv[1] == "hf":
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    ids = torch.randint(1, 64, (32, 12), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids[i], "labels": int(ids[i, 0] > 32)} for i in range(32)]
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=16, num_labels=2))
    args = TrainingArguments(output_dir=sys.argv[2], max_steps=4, per_device_train_batch_size=8, save_steps=2,
                             report_to=[], disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
else:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_index):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", devices="auto", max_steps=4, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Regression(), DataLoader(TensorDataset(torch.randn(32, 2)), batch_size=4))
print("trained", flush=True)

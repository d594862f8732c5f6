"""An unchanged Hugging Face Trainer script: no skylift import unless ``own`` is given.

    trainer_job.py OUTPUT_DIR MAX_STEPS [own]

A tiny BERT from its config class (no download), generated data, checkpoints every 3
steps. ``own``: the program adds skylift's callback itself (it must then run once).
Prints ``callbacks=<number of SkyliftCallbacks> step=<global step>`` at the end.
"""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

output_dir, max_steps = sys.argv[1], int(sys.argv[2])
generator = torch.Generator().manual_seed(1)
ids = torch.randint(1, 64, (64, 12), generator=generator)
data = [{"input_ids": ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": int(ids[i, 0] > 32)}
        for i in range(64)]
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32,
                                                 max_position_embeddings=16, num_labels=2))
args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=8, save_steps=3,
                         logging_steps=1, use_cpu=True, report_to=[], disable_tqdm=True, seed=0)
trainer = Trainer(model=model, args=args, train_dataset=data)
if sys.argv[3:] == ["own"]:
    from skylift.integrations.transformers import SkyliftCallback

    trainer.add_callback(SkyliftCallback())
trainer.train()
count = sum(type(callback).__name__ == "SkyliftCallback" for callback in trainer.callback_handler.callbacks)
print(f"callbacks={count} step={trainer.state.global_step}")

"""A Trainer job with a model that computes its own per-sample mean (``bert``) or one whose
loss uses the Trainer's item count (``llama``); no skylift import.

    loss_scale_job.py bert|llama OUTPUT_DIR [GRADIENT_ACCUMULATION_STEPS]

Tiny models built from their config classes (no download), generated data, 2 steps,
every step logged, the Trainer's checkpoint at the end (its log history is the Trainer's figure).
"""

import sys

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

kind, output_dir = sys.argv[1], sys.argv[2]
accumulation = int(sys.argv[3]) if len(sys.argv) > 3 else 1
ids = torch.randint(1, 64, (64, 12), generator=torch.Generator().manual_seed(1))
torch.manual_seed(0)
if kind == "bert":
    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=16, num_labels=2))
    data = [{"input_ids": ids[i], "labels": int(ids[i, 0] > 32)} for i in range(64)]
else:
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16))
    data = [{"input_ids": ids[i], "labels": ids[i]} for i in range(64)]
args = TrainingArguments(output_dir=output_dir, max_steps=2, per_device_train_batch_size=4,
                         gradient_accumulation_steps=accumulation, save_steps=2, logging_steps=1, use_cpu=True,
                         report_to=[], disable_tqdm=True, seed=0, learning_rate=1e-6)
Trainer(model=model, args=args, train_dataset=data).train()

"""A Trainer job whose rank 0 pauses itself at step 4 (SIGSTOP), its run lease living 2 s.

    lease_takeover_job.py OUTPUT_DIR

A tiny BERT from its config class (no download), generated data, 0.2 s a step,
checkpoints every 3 steps, up to 400 steps. Rank 0 stops itself at the end of step 4,
as a suspended machine or a debugger would stop it; a test then takes the stale lease
over from another process and lets rank 0 go on (SIGCONT).
"""

import os
import signal
import sys
import time

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from skylift.config.load import load_config
from skylift.integrations.transformers import SkyliftCallback


class SlowSteps(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.2)
        if state.global_step == 4 and args.process_index == 0:
            os.kill(os.getpid(), signal.SIGSTOP)


output_dir = sys.argv[1]
ids = torch.randint(1, 64, (64, 12), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": int(ids[i, 0] > 32)}
        for i in range(64)]
torch.manual_seed(0)
model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=32,
                                                 max_position_embeddings=16, num_labels=2))
args = TrainingArguments(output_dir=output_dir, max_steps=400, per_device_train_batch_size=8, save_steps=3,
                         logging_steps=1, use_cpu=True, report_to=[], disable_tqdm=True, seed=0)
config = load_config(None, ["checkpoint.lease_ttl_s=2", "preemption.cloud=off", "monitor.tensorboard=false",
                            "monitor.report=false", "monitor.system_interval_s=0"])
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[SlowSteps(), SkyliftCallback(config)])
trainer.train()
print(f"trained step={trainer.state.global_step}")

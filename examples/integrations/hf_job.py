"""A real Hugging Face ``Trainer`` job on a tiny BERT built from its config class (no download).

Importable (the in-process tests) and a script for ``skylift launch``::

    skylift launch --nproc 2 -- python examples/integrations/hf_job.py OUTPUT_DIR CONFIG [PAUSE_AT_STEP]

The data are generated: 12 token ids a sample, the label says whether the first one is in
the upper half of the vocabulary. ``PAUSE_AT_STEP`` (script only): rank 0 writes
``OUTPUT_DIR/paused-at`` at that step and waits for ``OUTPUT_DIR/go`` before
skylift's callback sees the step end, so a test can arm a spot notice at a known step.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from skylift.integrations.transformers import SkyliftCallback, resume_checkpoint

MAX_STEPS = 24
SAVE_STEPS = 8
SAMPLES = 256
SEQUENCE = 12
VOCABULARY = 64


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCABULARY, (SAMPLES, SEQUENCE), generator=generator)
    labels = (ids[:, 0] > VOCABULARY // 2).long()
    mask = torch.ones(SEQUENCE, dtype=torch.long)
    return [{"input_ids": ids[i], "attention_mask": mask, "labels": labels[i]} for i in range(SAMPLES)]


def model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCABULARY, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQUENCE + 4, num_labels=2)
    return BertForSequenceClassification(config)


def trainer(output_dir: Path, *, callbacks: list[TrainerCallback], max_steps: int = MAX_STEPS,
            save_steps: int = SAVE_STEPS) -> Trainer:
    """Seed 0, fp32 on the CPU, a loss logged every step, the Trainer's own checkpoints every ``save_steps``."""
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8, learning_rate=1e-3,
        save_steps=save_steps, save_total_limit=3, logging_steps=1, seed=0, use_cpu=True, report_to=[],
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False,
    )
    built = Trainer(model=model(), args=args, train_dataset=dataset())
    for callback in callbacks:
        built.add_callback(callback)
    return built


class PauseAt(TrainerCallback):
    """Holds rank 0 at the end of ``step`` until the test says go (added before skylift's callback)."""

    def __init__(self, output_dir: Path, step: int) -> None:
        self.output_dir, self.step = output_dir, step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001 - the Trainer's signature
        if state.global_step != self.step or not state.is_world_process_zero:
            return
        (self.output_dir / "paused-at").write_text(str(self.step))
        deadline = time.monotonic() + 120
        while not (self.output_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def main(argv: list[str]) -> None:
    output_dir, config = Path(argv[0]), argv[1]
    pause = [PauseAt(output_dir, int(argv[2]))] if len(argv) > 2 and not os.path.exists(output_dir / "go") else []
    job = trainer(output_dir, callbacks=[*pause, SkyliftCallback(config)])
    job.train(resume_from_checkpoint=resume_checkpoint(job))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The hand-written DDP loop of every tutorial, on skylift's Runtime.

The same model, data, optimizer and accumulation as ``own_loop_before.py``; what
changed: precision, DDP and the notice watch come from the config; the job saves
atomically in the background, resumes at the exact next batch after a kill, stops
cleanly on a spot notice (AWS, GCP, Azure, Alibaba Cloud, Tencent Cloud) or SIGTERM,
and writes metrics that ``skylift report`` and ``skylift monitor`` read.

    skylift launch --nproc 2 -- python examples/own_loop.py examples/own_loop.yaml
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

from skylift import Runtime
from skylift.data.datasets import digits  # your dataset here: 1,797 8x8 digits shipped with scikit-learn


def main() -> None:
    runtime = Runtime.from_config(sys.argv[1] if len(sys.argv) > 1 else "examples/own_loop.yaml", overrides=sys.argv[2:])
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = digits(0.2, seed=0).train
    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    model, optimizer, loader = runtime.prepare(model, optimizer, loader)
    step = runtime.resume()
    for epoch in range(runtime.epoch, runtime.config.schedule.epochs):
        for images, labels in loader:
            with runtime.autocast():
                loss = nn.functional.cross_entropy(model(images), labels)
            runtime.backward(loss)
            if runtime.optimizer_step():
                step += 1
                runtime.log(step, loss=loss)
                if runtime.step_end(step):
                    break
        if runtime.stopped:
            break
    runtime.close()


if __name__ == "__main__":
    main()

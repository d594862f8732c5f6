"""The hand-written DDP loop of every tutorial, as it stands before skylift.

DDP set-up, a GradScaler with autocast, gradient accumulation over 4 micro-batches,
and a spot-interruption check that saves with ``torch.save``. It runs (on GPUs with
NCCL, on CPUs with gloo), but on a spot VM its job is lost: the check only looks
every 20 steps, the save is not atomic and is never read back, and a restart begins
at step 0. ``own_loop.py`` is the same loop on skylift's Runtime.

    torchrun --nproc-per-node 2 examples/own_loop_before.py
"""

import os
import urllib.request

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from skylift.data.datasets import digits  # your dataset here: 1,797 8x8 digits shipped with scikit-learn

ACCUMULATION_STEPS = 4
EPOCHS = 3


def spot_interruption_noticed() -> bool:
    try:  # AWS's notice; IMDSv2 needs a token first, which this check forgets
        with urllib.request.urlopen("http://169.254.169.254/latest/meta-data/spot/instance-action", timeout=1):
            return True
    except OSError:
        return False


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dataset = digits(0.2, seed=0).train
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler)
    scaler = torch.amp.GradScaler(enabled=cuda)
    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for i, (images, labels) in enumerate(loader):
            images, labels = images.to(device), labels.to(device)
            with torch.autocast(device.type, enabled=cuda):
                loss = nn.functional.cross_entropy(model(images), labels)
            scaler.scale(loss / ACCUMULATION_STEPS).backward()
            if (i + 1) % ACCUMULATION_STEPS == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                step += 1
                if rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item():.4f}")
                if step % 20 == 0 and spot_interruption_noticed():
                    if rank == 0:
                        torch.save(model.state_dict(), "checkpoint.pt")
                    dist.destroy_process_group()
                    return
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

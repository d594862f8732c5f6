"""A worker module for tests/train/test_preloaded_workers.py: ``main(argv)`` writes what a
forked worker sees to ``FOLDER/rankN.json``, prints a line and, once every rank wrote its
file, returns ``EXIT_CODE``."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    folder, exit_code = Path(argv[0]), int(argv[1])
    rank = int(os.environ["RANK"])
    offset = rank * 10

    def collate(batch: list[int]) -> list[int]:  # local, as a recipe's may be: a forked loader worker takes it
        return [offset + value for value in batch]

    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, num_workers=1, collate_fn=collate)
    facts = {"set_after_the_server_started": os.environ.get("SKYLIFT_TEST_SET_LATE"),
             "start_method": multiprocessing.get_start_method(), "threads": torch.get_num_threads(),
             "name": Path(f"/proc/{os.getpid()}/comm").read_text().strip() if sys.platform == "linux" else None,
             "batches": list(loader), "argv": sys.argv[1:]}  # fmt: skip
    (folder / f"rank{rank}.json").write_text(json.dumps(facts))
    print(f"probe rank {rank} says hello", flush=True)
    # A rank's non-zero exit makes torchrun's agent stop the others: on a loaded machine
    # rank 0's 143 came before rank 1 had written its facts. Leave together.
    deadline_s = time.monotonic() + 60
    while not all((folder / f"rank{peer}.json").exists() for peer in range(int(os.environ["WORLD_SIZE"]))):
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"rank {rank}: a peer wrote no facts within 60 s")
        time.sleep(0.05)
    return exit_code

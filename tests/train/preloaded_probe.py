"""A worker module for tests/train/test_preloaded_workers.py: ``main(argv)`` writes what a
forked worker sees to ``FOLDER/rankN.json``, prints a line and returns ``EXIT_CODE``."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
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
    print(f"probe rank {rank} says hello")
    return exit_code

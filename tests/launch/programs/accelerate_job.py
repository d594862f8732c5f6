"""A script written for ``accelerate launch``: no skylift import.

    accelerate_job.py OUTPUT_DIR

Forms accelerate's process group on the CPU, sums the ranks over it, and writes
``rank<N>.json``: its process ids, the world it saw and whether skylift's hook is in it.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

state = PartialState(cpu=True)
total = torch.tensor([float(state.process_index + 1)])
dist.all_reduce(total)
record = {"pid": os.getpid(), "parent_pid": os.getppid(), "world_size": state.num_processes,
          "sum_of_ranks": total.item(), "hooked": "skylift.integrations.attach" in sys.modules}
Path(sys.argv[1], f"rank{state.process_index}.json").write_text(json.dumps(record))

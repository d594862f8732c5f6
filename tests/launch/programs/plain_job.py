"""An unchanged torchrun script (no skylift import) with the SIGTERM handler such scripts should have.

    plain_job.py FOLDER [STEPS]

Each rank writes ``FOLDER/pid<rank>`` then "trains" ``STEPS`` steps (default: until
stopped) of ``helper_module.STEP_SECONDS`` each, writing ``FOLDER/step<rank>``. On SIGTERM
it saves ``FOLDER/saved<rank>`` (the step it reached) and exits 0.
"""

import os
import signal
import sys
import time

import helper_module  # a sibling: found only with the script's folder on sys.path

folder, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 10**9
rank = os.environ["RANK"]
stop = []
signal.signal(signal.SIGTERM, lambda number, frame: stop.append(number))
with open(os.path.join(folder, f"pid{rank}"), "w") as handle:
    handle.write(str(os.getpid()))
step = 0
while step < steps and not stop:
    time.sleep(helper_module.STEP_SECONDS)
    step += 1
    with open(os.path.join(folder, f"step{rank}"), "w") as handle:
        handle.write(str(step))
if stop:
    with open(os.path.join(folder, f"saved{rank}"), "w") as handle:
        handle.write(str(step))

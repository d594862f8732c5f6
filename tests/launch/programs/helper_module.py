"""A sibling module: ``plain_job.py`` imports it as plain torchrun would let it."""

STEP_SECONDS = 0.05

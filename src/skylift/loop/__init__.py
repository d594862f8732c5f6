"""The training loop's primitives: its events and state, the process group, the ranks' agreement.

Below everything that takes part in a step (data loaders, checkpoints, monitors, the
Trainer), so each of them can import these without importing the others.
"""

"""Checkpoints: snapshot and restore, the manifest commit, the async manager, the run lease and the node-local copy."""

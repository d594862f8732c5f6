"""Data: datasets, rank-aware samplers and loaders."""

from skylift.data.sampler import GlobalBatchSampler, ShardedEvalSampler

__all__ = ["GlobalBatchSampler", "ShardedEvalSampler"]

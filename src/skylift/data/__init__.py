"""Data: datasets, rank-aware samplers and loaders."""

from skylift.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from skylift.data.token_budget import TokenBudgetBatchSampler

__all__ = ["GlobalBatchSampler", "ShardedEvalSampler", "TokenBudgetBatchSampler"]

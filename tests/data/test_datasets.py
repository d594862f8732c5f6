from __future__ import annotations

import torch

from skylift.data.datasets import digits, stratified_split


def test_digits_are_scikit_learns_digits():
    from sklearn.datasets import load_digits

    reference = torch.tensor(load_digits().images, dtype=torch.float32) / 16.0
    split = digits(0.2, seed=0)
    images = torch.cat([split.train.tensors[0], split.val.tensors[0]]).squeeze(1)
    assert images.shape[0] == reference.shape[0] == 1797
    assert torch.equal(images.sum(0), reference.sum(0))  # the same samples, split apart
    assert split.in_channels == 1 and split.num_classes == 10


def test_split_is_stratified_seeded_and_disjoint():
    labels = torch.arange(10).repeat_interleave(50)
    train, val = stratified_split(labels, 0.2, seed=3)
    again_train, _ = stratified_split(labels, 0.2, seed=3)
    assert torch.equal(train, again_train)
    assert not set(train.tolist()) & set(val.tolist())
    assert len(train) + len(val) == 500
    assert torch.bincount(labels[val], minlength=10).tolist() == [10] * 10

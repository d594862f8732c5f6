"""FLOPs of a Hugging Face BERT step, against the analytic count of its matmuls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from skylift.monitor.flops import count_step_flops, explain_step_flops

transformers = pytest.importorskip("transformers")

BATCH, SEQUENCE, HIDDEN, LAYERS, HEADS, FEED_FORWARD, LABELS, VOCAB = 3, 16, 32, 2, 4, 64, 2, 100


def _tiny_bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FEED_FORWARD, max_position_embeddings=64, num_labels=LABELS,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _loss(model: nn.Module, batch):
    # The text classification recipe's training_loss, word for word.
    input_ids, attention_mask, labels = batch
    return nn.functional.cross_entropy(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)


def _batch(padded_tokens: int = 0):
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    if padded_tokens:
        attention_mask[0, -padded_tokens:] = 0  # a real mask: the model cannot skip it
    return input_ids, attention_mask, torch.zeros(BATCH, dtype=torch.long)


def _analytic_training_flops() -> int:
    """Forward matmuls times 3 (backward computes the weight and the input gradient of each).

    Every linear sees gradients for its input: the embeddings are trained, so even the
    first projection needs one. That is 6 x weights x tokens for the encoder's linears
    (4 d^2 attention projections, 2 d f feed-forward), the pooler and classifier on one
    token per sequence, and attention's two s x s products (QK^T and AV, 2 s^2 d each
    forward, backward twice that): 12 L d s^2 per sequence.
    """
    tokens = BATCH * SEQUENCE
    encoder_weights = 4 * HIDDEN * HIDDEN + 2 * HIDDEN * FEED_FORWARD
    encoder = 6 * encoder_weights * tokens * LAYERS
    attention = 12 * LAYERS * HIDDEN * SEQUENCE**2 * BATCH
    head = 6 * (HIDDEN * HIDDEN + HIDDEN * LABELS) * BATCH
    return encoder + attention + head


@pytest.mark.parametrize("padded_tokens", [0, 5], ids=["all-ones-mask", "padded-mask"])
def test_bert_step_matches_the_analytic_count(padded_tokens):
    flops, reason = explain_step_flops(_tiny_bert(), _batch(padded_tokens), _loss)
    # FlopCounterMode counts matmuls and attention only; softmax, layernorm, GELU and the
    # embedding lookup are omitted by the counter and by the analytic formula alike, so both
    # sum the same integer products: equal exactly, with or without a padded mask (the
    # mask changes which scores count, not how many are computed).
    assert reason == "counted on meta"
    assert flops == _analytic_training_flops()


def test_counting_bert_leaves_batch_model_and_random_state_alone():
    model = _tiny_bert()
    batch = _batch(padded_tokens=5)
    before_batch = [tensor.clone() for tensor in batch]
    before_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    torch.manual_seed(3)
    expected_draw = torch.rand(4)
    torch.manual_seed(3)
    assert count_step_flops(model, batch, _loss) is not None
    assert torch.equal(torch.rand(4), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(before_batch, batch, strict=True))
    assert all(torch.equal(before_state[name], tensor) for name, tensor in model.state_dict().items())
    assert all(parameter.grad is None for parameter in model.parameters())


class _RoutesOnActivations(nn.Module):
    """Reads a value of its activations: no meta run can know which branch runs."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.left, self.right = nn.Linear(4, 1), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.left(inputs) if self.gate(inputs).sum() > 0 else self.right(inputs)


def test_a_model_that_reads_its_activations_says_why_it_cannot_be_counted(caplog):
    batch = (torch.randn(2, 4), torch.zeros(2, dtype=torch.long))

    def loss(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    flops, reason = explain_step_flops(_RoutesOnActivations(), batch, loss)
    assert flops is None and "meta device" in reason and "item()" in reason
    with caplog.at_level("WARNING", logger="skylift"):
        assert count_step_flops(_RoutesOnActivations(), batch, loss) is None
    assert "FLOPs not counted, so no MFU" in caplog.text

"""Hidden checks for exercise 01 (graded, never released): the byte counters on models, optimizers
and dtypes the public tests do not use.

The public tests count the course model (its default shape) and a two-layer stand-in, under AdamW.
Here: other optimizers (SGD with momentum: one buffer; Adam with amsgrad: three), a bf16 model,
other model shapes (three layers, plain multi-head attention, tied embeddings) against the course's
meter and the calculator, and tensors saved twice through views.
"""

import pytest
import torch

from labs.experiments.common import course_spec
from labs.measure.memory import SavedActivations, state_bytes
from labs.models.transformer import ModelConfig, build_model
from labs.runtime import exercise
from labs.theory.memory import memory_per_rank
from tests.helpers import in_child

pytestmark = pytest.mark.exercise


def _one_step(model, optimizer, vocab, batch=2, seq=8):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    model(idx, targets)[1].backward()
    optimizer.step()


OPTIMIZERS = {  # name -> (its optimizer on some parameters, moments per parameter)
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    "adam-amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), 3),
}


def _trained(case: str):
    """A model and its optimizer after one step: an ``OPTIMIZERS`` case, or ``bf16-frozen-tied``
    (a bf16 model, its first layer frozen, tied embeddings, AdamW)."""
    if case in OPTIMIZERS:
        model = build_model(ModelConfig(), seed=0)
        optimizer = OPTIMIZERS[case][0](model.parameters())
    else:
        model = build_model(ModelConfig(tie_embeddings=True), seed=0, dtype=torch.bfloat16)
        for p in model.layers[0].parameters():
            p.requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _one_step(model, optimizer, vocab=256)
    return model, optimizer


def _counted(case: str) -> dict:
    """What the learner's counter says of ``_trained(case)`` (in a child: exercise code never runs
    in the test process); the test computes what it should say itself."""
    model, optimizer = _trained(case)
    return exercise("activations").training_state_bytes(model, optimizer)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_state_under_other_optimizers(name):
    got = in_child(_counted, name)
    model, optimizer = _trained(name)
    expected = state_bytes(model, optimizer)
    assert got == {k: expected[k] for k in ("params", "grads", "optimizer")}, (name, got, expected)
    assert got["optimizer"] == OPTIMIZERS[name][1] * got["params"], name


def test_training_state_of_a_bf16_model_with_a_frozen_layer_and_tied_embeddings():
    """2 bytes per element; the frozen layer has parameters but no gradient and no state; the tied
    head is the embedding's tensor, counted once."""
    got = in_child(_counted, "bf16-frozen-tied")
    model, optimizer = _trained("bf16-frozen-tied")
    expected = state_bytes(model, optimizer)
    assert got == {k: expected[k] for k in ("params", "grads", "optimizer")}, (got, expected)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert got["grads"] == 2 * trainable and got["optimizer"] == 2 * 2 * trainable


def _saved_and_backward(model, idx, targets):
    """The learner's count of saved bytes, and whether every parameter got a gradient after the
    backward of the loss it returned (in a child)."""
    loss, saved = exercise("activations").saved_activation_bytes(model, idx, targets)
    loss.backward()
    return saved, [p.grad is not None for p in model.parameters()]


@pytest.mark.parametrize(
    "cfg, dtype",
    [
        (ModelConfig(n_layer=3, n_embd=32, n_head=4, n_kv_head=4, ffn_hidden=96), torch.float32),
        (ModelConfig(n_layer=1, tie_embeddings=True), torch.bfloat16),
    ],
    ids=["3-layers-mha-fp32", "1-layer-tied-bf16"],
)
def test_saved_activations_of_other_shapes_equal_the_meter_and_the_calculator(cfg, dtype):
    model = build_model(cfg, seed=0, dtype=dtype)
    batch, seq = 3, 24
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    with SavedActivations(exclude=model) as meter:
        model(idx, targets)
    saved, grads = in_child(_saved_and_backward, model, idx, targets)
    assert saved == meter.bytes, f"{saved} bytes counted, the course's meter saw {meter.bytes}"
    predicted = memory_per_rank(
        course_spec(cfg),
        seq=seq,
        mbs=batch,
        precision="fp32" if dtype == torch.float32 else "bf16-mixed",
    )
    assert saved == predicted["activation_bytes"], (saved, predicted["activation_bytes"])
    assert all(grads), "a parameter got no gradient from the loss it returned"


class SavesViews(torch.nn.Module):
    """One activation saved three times, through two views of it and itself; a parameter saved
    too. Its storage counts once, the parameter's not at all."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 4))

    def forward(self, idx, targets):
        h = torch.tanh(idx.float().unsqueeze(-1) * torch.ones(4))  # [B, T, 4], saved by tanh
        left, right = h[..., :2], h[..., 2:]  # two views of h's storage
        mixed = (left * right).sum(-1, keepdim=True) * h  # saves left, right and h
        logits = mixed @ self.weight.t()  # [B, T, 6]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_views_of_one_storage_count_once():
    model = SavesViews()
    idx = torch.randint(0, 6, (2, 5))
    targets = torch.randint(0, 6, (2, 5))
    with SavedActivations(exclude=model) as meter:
        model(idx, targets)
    saved, grads = in_child(_saved_and_backward, model, idx, targets)
    assert saved == meter.bytes, f"{saved} bytes counted, the course's meter saw {meter.bytes}"
    assert all(grads), "the weight got no gradient from the loss it returned"

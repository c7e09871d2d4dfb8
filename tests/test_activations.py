"""Exercise 01: the learner's byte counts (training state, saved activations) equal the course's
meter and the memory calculator, to the byte."""

import pytest
import torch
import torch.nn.functional as F

from labs.experiments.common import course_spec
from labs.measure.memory import SavedActivations, state_bytes
from labs.models.transformer import ModelConfig, build_model
from labs.runtime import exercise
from labs.theory.memory import memory_per_rank
from labs.train import TrainConfig, data_for, make_optimizer
from tests.helpers import in_child

pytestmark = pytest.mark.exercise


class EmbedHead(torch.nn.Module):
    """A two-layer stand-in with the course model's signature; its head is tied to the
    embedding (one tensor, two uses) and a frozen bias is saved by nothing."""

    def __init__(self, vocab=16, hidden=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.bias = torch.nn.Parameter(torch.zeros(vocab), requires_grad=False)

    def forward(self, idx, targets):
        x = self.emb(idx)  # [B, T, H]
        logits = F.linear(torch.tanh(x), self.emb.weight, self.bias)  # [B, T, V]
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch_size, seq_len", [(8, 32), (2, 64)])
def test_saved_activations_equal_the_calculator(dtype, batch_size, seq_len):
    rows = in_child(measure_course_model, dtype=dtype, batch_size=batch_size, seq_len=seq_len)
    predicted = memory_per_rank(
        course_spec(ModelConfig()),
        seq=seq_len,
        mbs=batch_size,
        precision="fp32" if dtype == torch.float32 else "bf16-mixed",
    )
    assert rows["activations"] == {
        "measured": predicted["activation_bytes"],
        "calculator": predicted["activation_bytes"],
    }, f"saved activations, {dtype}, B={batch_size}, T={seq_len}: {rows['activations']}"


def measure_course_model(**kw):
    return exercise("activations").measure_course_model(**kw)


def saved_activation_bytes(model, idx, targets):
    """The learner's count, and whether backward still works after it (every gradient made)."""
    loss, saved = exercise("activations").saved_activation_bytes(model, idx, targets)
    loss.backward()  # the pack hook must hand autograd the tensors back
    grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return loss.detach(), saved, grads


@pytest.mark.parametrize("model_name", ["course", "tied"])
def test_saved_activations_equal_the_course_meter_and_backward_still_works(model_name):
    torch.manual_seed(0)
    model = build_model(ModelConfig(), seed=0) if model_name == "course" else EmbedHead()
    vocab = 256 if model_name == "course" else 16
    idx = torch.randint(0, vocab, (4, 16))
    targets = torch.randint(0, vocab, (4, 16))
    with SavedActivations(exclude=model) as meter:
        expected_loss = model(idx, targets)[1]
    loss, saved, grads = in_child(saved_activation_bytes, model, idx, targets)
    assert saved == meter.bytes, f"{model_name}: {saved} bytes counted, the meter saw {meter.bytes}"
    assert torch.equal(loss, expected_loss)
    assert grads, "after saved_activation_bytes, backward must still reach every parameter"


def training_state_before_and_after_a_step():
    """The learner's training-state bytes of a tied model before and after a step, and the
    course's own count after it."""
    activations = exercise("activations")
    model = EmbedHead()
    optimizer = make_optimizer(model.parameters(), TrainConfig())
    idx, targets = data_for(TrainConfig(batch_size=2, seq_len=8))[0]
    before = activations.training_state_bytes(model, optimizer)
    model(idx % 16, targets % 16)[1].backward()
    optimizer.step()
    return before, activations.training_state_bytes(model, optimizer), state_bytes(model, optimizer)


def test_training_state_equals_the_calculator_and_counts_tied_weights_once():
    rows = in_child(measure_course_model)
    for name in ("params", "grads", "optimizer"):
        assert rows[name]["measured"] == rows[name]["calculator"], (name, rows[name])
    assert rows["optimizer"]["measured"] == 2 * rows["params"]["measured"]  # AdamW: two moments
    before, after, expected = in_child(training_state_before_and_after_a_step)
    assert before == {"params": (16 * 8 + 16) * 4, "grads": 0, "optimizer": 0}, before
    assert after == {k: expected[k] for k in ("params", "grads", "optimizer")}, (after, expected)
    assert after["grads"] == 16 * 8 * 4  # the frozen bias has no gradient

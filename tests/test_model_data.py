"""The course model, the transformers adapters, the data, and the reference trainer."""

import pytest
import torch

from labs.data import ByteTokenizer, TokenWindows, global_batches, load_corpus, rank_batches
from labs.models import ModelConfig, build_model, count_params
from labs.models.hf import build_hf_gpt2, to_hf_llama
from labs.train import TrainConfig, assert_close_tensors, train_reference


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("n_kv_head", [8, 4, 1])
def test_course_model_is_a_llama(tie, n_kv_head):
    """Same weights -> the same logits as transformers' LlamaForCausalLM, to the last bit."""
    cfg = ModelConfig(tie_embeddings=tie, n_kv_head=n_kv_head)
    model = build_model(cfg, seed=3)
    hf = to_hf_llama(model)
    assert count_params(model) == sum(p.numel() for p in hf.parameters())
    idx = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(idx), hf(idx).logits)


def test_norms_and_loss_run_in_the_models_dtype_from_fp32_up():
    """float64 stays float64 through RMSNorm and the loss (a lab checks parameters in float64 to
    1e-12); fp32 runs the very ops it ran before (``.float()`` on fp32 is the tensor itself); bf16
    computes both in fp32, as Llama does."""
    cfg = ModelConfig()
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float64, torch.float32):
        model = build_model(cfg, seed=1, dtype=dtype)
        x = torch.randn(2, 16, cfg.n_embd, generator=torch.Generator().manual_seed(1), dtype=dtype)
        norm = model.norm
        wide = x.double() if dtype == torch.float64 else x.float()
        by_hand = norm.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + norm.eps))
        assert norm(x).dtype == dtype and torch.equal(norm(x), by_hand.to(dtype))
        logits, loss = model(idx, idx)
        wide = logits.double() if dtype == torch.float64 else logits.float()
        expected = torch.nn.functional.cross_entropy(wide.view(-1, cfg.vocab_size), idx.view(-1))
        assert loss.dtype == dtype and torch.equal(loss, expected)
    model = build_model(cfg, seed=1, dtype=torch.bfloat16)
    assert model(idx, idx)[1].dtype == torch.float32


def test_same_seed_same_weights_different_seed_different_weights():
    a, b, c = (build_model(ModelConfig(), seed=s) for s in (0, 0, 1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].attn.q_proj.weight, c.layers[0].attn.q_proj.weight)


def test_model_config_rejects_bad_dimensions():
    with pytest.raises(ValueError, match="n_embd=60 is not divisible by n_head=8"):
        ModelConfig(n_embd=60)
    with pytest.raises(ValueError, match="n_head=8 is not divisible by n_kv_head=3"):
        ModelConfig(n_kv_head=3)
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        ModelConfig(n_layer=0)


def test_gpt2_builds_offline():
    model = build_hf_gpt2(n_layer=1, n_embd=32, n_head=2)
    assert model(torch.zeros(1, 8, dtype=torch.long)).logits.shape == (1, 8, 256)


def test_corpus_and_tokenizer():
    tokens = load_corpus()
    assert 50_000 < len(tokens) < 500_000 and int(tokens.max()) < 256
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("ring all-reduce ✓")) == "ring all-reduce ✓"
    x, y = TokenWindows(16)[3]
    assert torch.equal(x[1:], y[:-1])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_see_disjoint_data_and_the_global_batch_is_the_same_for_any_world_size(world):
    per_rank = [
        rank_batches(steps=3, batch_size=8 // world, seq_len=16, rank=r, world_size=world)
        for r in range(world)
    ]
    for step in range(3):
        rows = [tuple(row.tolist()) for r in range(world) for row in per_rank[r][step][0]]
        assert len(set(rows)) == len(rows), "two ranks got the same sample"
    single = global_batches(steps=3, batch_size=8, seq_len=16, world_size=1)
    multi = global_batches(steps=3, batch_size=8 // world, seq_len=16, world_size=world)
    for (xs, _), (xm, _) in zip(single, multi):
        assert sorted(map(tuple, xs.tolist())) == sorted(map(tuple, xm.tolist()))


def test_epochs_reshuffle_with_set_epoch():
    windows = len(TokenWindows(512))
    batches = rank_batches(steps=2 * (windows // 4), batch_size=4, seq_len=512)
    first = batches[: windows // 4]
    second = batches[windows // 4 :]
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, second))


def test_reference_trainer_learns_and_is_deterministic():
    cfg = TrainConfig(steps=8)
    a = train_reference(ModelConfig(), cfg, return_grads=True)
    b = train_reference(ModelConfig(), cfg)
    assert a.losses == b.losses
    assert a.losses[-1] < a.losses[0] - 0.5
    assert set(a.grads) == {n for n, _ in build_model(ModelConfig()).named_parameters()}
    assert assert_close_tensors(a.params, b.params) == 0.0


def test_assert_close_tensors_names_what_differs():
    ref = {"w": torch.ones(3)}
    with pytest.raises(
        AssertionError, match=r"parameter w at step 2 on rank 1: max relative difference 1\.000e-03"
    ):
        assert_close_tensors({"w": torch.tensor([1.0, 1.0, 1.001])}, ref, step=2, rank=1)

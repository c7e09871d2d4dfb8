"""Exercise 09: greedy generation with a KV cache gives exactly the tokens of generation without one
(each prompt alone, recomputed every step) and of transformers' generate, on one rank,
tensor-parallel and placed; cache bytes, weights and collectives per token equal
labs.theory.inference."""

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments import infer
from labs.measure import CommLedger
from labs.models.transformer import build_model, rotary_cos_sin
from labs.runtime import exercise
from labs.theory import inference as theory
from tests.helpers import checks_ok, in_child, lab_json

CFG = infer.CONFIG
PROMPTS = infer.make_prompts(4)  # 6, 11, 16 and 10 tokens: left padding is exercised
NEW = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread in this process, as each rank has.

    On a busy 2-core machine a second one costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, seed=0).eval()


@pytest.fixture(scope="module")
def reference(model):
    return infer.no_cache_tokens(model, PROMPTS, NEW)


# --- harness and plumbing (given code: not exercises)
# -----------------------------------------------------------
def test_prompts_have_different_lengths_and_are_reproducible():
    assert [len(p) for p in PROMPTS] == [6, 11, 16, 10]
    assert infer.make_prompts(4) == PROMPTS and infer.make_prompts(4, seed=1) != PROMPTS


def test_left_padding_positions_and_mask():
    inference = exercise("inference")
    idx, valid = inference.left_pad([[5, 6, 7], [8]], new_tokens=2)
    assert idx.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert valid.tolist() == [[True] * 5, [False, False, True, True, True]]
    mask = inference.attention_mask(valid, 0, 3)[:, 0]  # [B, t, S]
    assert mask[0].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    # pads read pads; the real token reads itself
    assert mask[1].tolist() == [
        [1, 0, 0],
        [1, 1, 0],
        [0, 0, 1],
    ]
    # decode: never a pad
    assert inference.attention_mask(valid, 3, 1)[1, 0].tolist() == [[0, 0, 1, 1]]
    # slots 2, 3: positions 2, 3 and 0, 1
    cos, _ = inference.rope_for(valid, 2, 2, CFG, torch.float32)
    expected, _ = rotary_cos_sin(torch.tensor([2, 3, 0, 1]), CFG.head_dim, CFG.rope_theta)
    assert torch.equal(cos[:, 0].reshape(4, -1), expected)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(mode="pipeline"), "mode='pipeline' is not one of"),
        (dict(model="gpt2"), "model='gpt2' is not one of"),
        (dict(nproc=3, mode="tp"), r"n_head=8 is not divisible by tp=3; use tp in \{1,2,4\}"),
        (dict(nproc=5, mode="placement"), "pp=5 stages but the model has 4 layers"),
        (dict(new_tokens=1), "new_tokens=1"),
        (dict(new_tokens=60), "use new_tokens <= 48"),
        (dict(prompts=0), "prompts must be an integer >= 1"),
        (dict(steps=0), "steps must be an integer >= 1, got 0"),
    ],
)
def test_bad_options_are_value_errors_before_any_rank_starts(options, message):
    with pytest.raises(ValueError, match=message):
        infer.run(**{"nproc": 2, **options})


# --- the exercises
# ------------------------------------------------------------------------------------------
def cache_write(k, v):
    """The learner's cache written at layer 1 from position 2: what it returns and holds."""
    cache = exercise("inference").KVCache(n_layer=2, batch=2, max_len=8, n_kv_head=2, head_dim=4)
    nbytes = cache.nbytes
    keys, values = cache.write(1, 2, k, v)
    return {
        "nbytes": (nbytes, cache.nbytes),
        "keys": keys.clone(),
        "values": values.clone(),
        "views": keys.data_ptr() == cache.k[1].data_ptr()
        and values.data_ptr() == cache.v[1].data_ptr(),
        "layer 1": cache.k[1][:, :, 2:5].clone(),
        "layer 0 written": bool(cache.k[0].any()),
    }


@pytest.mark.exercise
def test_cache_write_is_in_place_and_returns_views():
    k = torch.randn(2, 2, 3, 4)
    v = torch.randn(2, 2, 3, 4)
    r = in_child(cache_write, k, v)
    keys, values = r["keys"], r["values"]
    assert r["nbytes"][0] == 2 * 2 * 2 * 8 * 2 * 4 * 4
    assert keys.shape == values.shape == (2, 2, 5, 4)
    assert torch.equal(keys[:, :, 2:], k) and torch.equal(values[:, :, 2:], v)
    assert r["views"], "write must return views of the cache's own tensors"
    assert torch.equal(r["layer 1"], k) and not r["layer 0 written"]
    assert r["nbytes"][1] == 2 * 2 * 2 * 8 * 2 * 4 * 4  # no new memory


def cached_attention(model, x):
    """The learner's cached attention of layer 0: a 5-token prompt, then one step."""
    inference = exercise("inference")
    attn = model.layers[0].attn
    cache = inference.KVCache.for_blocks(list(model.layers), batch=2, max_len=6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        prompt = inference.cached_attention(
            attn,
            x[:, :5],
            *inference.rope_for(valid, 0, 5, CFG, torch.float32),
            cache=cache,
            layer=0,
            start=0,
            mask=inference.attention_mask(valid, 0, 5),
        )
        step = inference.cached_attention(
            attn,
            x[:, 5:],
            *inference.rope_for(valid, 5, 1, CFG, torch.float32),
            cache=cache,
            layer=0,
            start=5,
            mask=inference.attention_mask(valid, 5, 1),
        )
    return torch.cat([prompt, step], 1)


@pytest.mark.exercise
def test_cached_attention_equals_the_models_attention(model):
    attn = model.layers[0].attn
    x = torch.randn(2, 6, CFG.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = attn(x, *rotary_cos_sin(torch.arange(6), CFG.head_dim, CFG.rope_theta))
    got = in_child(cached_attention, model, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def generated(model, prompts):
    """The learner's tokens for ``prompts``, and its cache's bytes."""
    out = exercise("inference").generate(model, prompts, new_tokens=NEW)
    return out.tokens, out.cache.nbytes


@pytest.mark.exercise
def test_generate_equals_recompute_without_cache_each_prompt_alone(model, reference):
    tokens, cache_bytes = in_child(generated, model, PROMPTS)
    assert torch.equal(tokens, reference), (tokens, reference)
    # the longest: no padding at all
    alone, _ = in_child(generated, model, PROMPTS[2:3])
    assert torch.equal(alone[0], reference[2])
    spec = infer.course_spec(CFG)
    assert cache_bytes == theory.kv_cache_bytes_per_rank(spec, batch=4, seq=16 + NEW, dtype_bytes=4)


@pytest.mark.exercise
def test_generate_equals_transformers_generate(model):
    from labs.models.hf import to_hf_llama
    from labs.models.hf_convert import course_model_from

    hf = to_hf_llama(model)
    for prompts in (PROMPTS, [p[:6] for p in PROMPTS]):  # left-padded, then equal lengths
        ours, _ = in_child(generated, course_model_from(hf), prompts)
        assert torch.equal(ours, infer.hf_generate_tokens(hf, prompts, NEW))


def greedy_case(vocab: int) -> dict:
    """Logits [3, V] split over the ranks.

    Rows: a tie across two ranks, a maximum on the last rank, all equal."""
    full = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    full[0, [10, vocab - 1]] = 9.0  # tie between rank 0 and the last rank: the lower id wins
    full[1, vocab - 3] = 9.0
    full[2] = 1.0  # all equal: id 0
    n = dist.get_world_size()
    r = dist.get_rank()
    mine = full.chunk(n, dim=-1)[r]
    with CommLedger() as ledger:
        got = exercise("inference").greedy(mine, dist.group.WORLD)
    return {"got": got, "expected": full.argmax(-1), "ops": [rec.op for rec in ledger.records]}


@pytest.mark.exercise
@pytest.mark.parametrize("nproc", [2, 4])
def test_vocab_parallel_greedy_equals_argmax_with_one_all_gather(nproc):
    for r in launch(greedy_case, nproc, 256):
        assert torch.equal(r["got"], r["expected"]) and r["expected"].tolist() == [10, 253, 0]
        assert r["ops"] == ["all_gather_single"]


def _check_mode(s, mode: str, nproc: int) -> None:
    """The checks of ``mode`` in the summary ``s`` (tokens, every message of the prefill and of each
    decode step, KV-cache and weight bytes) all passed, and its figures say the same."""
    summary = s[mode] if s["mode"] == "both" else s
    assert checks_ok(s, f"{mode}: greedy tokens"), summary["tokens"]
    mine = [c for c in s.checks if c.name.startswith(f"{mode}: ")]
    assert len(mine) >= 6 and all(c.ok for c in mine), s.verdict()
    assert summary["kv_cache_bytes_per_rank"] == summary["theory_kv_cache_bytes_per_rank"]
    assert summary["weight_bytes_per_rank"] == summary["theory_weight_bytes_per_rank"]
    assert summary["ranks_with_tokens"] == (nproc if summary["mode"] == "tp" else min(nproc, 2))


# The lab's parts (PARTS in labs/inference.py): the KV cache, greedy decoding and TP generation are
# the core; layer placement (generate_placed) is the "placement" extension.
PLACEMENT = pytest.mark.part("placement")


@pytest.mark.exercise
@PLACEMENT
def test_both_modes_on_two_ranks_match_and_equal_the_theory():
    s = infer.run(nproc=2, mode="both", steps=1, new_tokens=NEW)
    assert s["matches_reference"] and checks_ok(s, "one rank: greedy tokens")
    for mode in ("tp", "placement"):
        _check_mode(s, mode, 2)
    # TP: each rank caches half the kv heads of every layer; placement: every kv head of half the
    # layers
    assert s["tp"]["kv_cache_bytes_per_rank"] == [s["single_kv_cache_bytes"] // 2] * 2
    assert s["tp"]["comm_decode"][0]["all_reduce"]["calls"] == 2 * CFG.n_layer + 1
    # [B, 1, H] fp32
    assert s["placement"]["comm_decode"][0]["send"]["payload_bytes"] == 4 * CFG.n_embd * 4
    rows = [r.replace(",", "").split() for r in infer.comm_report(s).splitlines()[1:]]
    assert rows and all(r[4:7] == r[7:10] for r in rows)  # measured calls, payload, sent = theory's


@pytest.mark.exercise
@pytest.mark.parametrize(
    "nproc, mode",
    [(4, "tp"), pytest.param(3, "placement", marks=PLACEMENT)],  # 3 stages: layers (2, 1, 1)
)
def test_four_way_tp_and_uneven_placement(nproc, mode):
    s = infer.run(nproc=nproc, mode=mode, steps=1, new_tokens=NEW)
    _check_mode(s, mode, nproc)
    if mode == "placement":
        assert s["kv_cache_bytes_per_rank"][0] == 2 * s["kv_cache_bytes_per_rank"][1]


@pytest.mark.exercise
@PLACEMENT
def test_transformers_llama_in_both_modes_matches_its_own_generate():
    s = in_child(infer.run, nproc=2, mode="both", steps=1, new_tokens=NEW, model="hf-llama")
    assert s["reference"] == "transformers generate" and s["matches_reference"]
    assert checks_ok(s, "one rank: greedy tokens")
    for mode in ("tp", "placement"):
        _check_mode(s, mode, 2)


@pytest.mark.exercise
@PLACEMENT
def test_command_line_reports_tokens_match_latency_and_throughput():
    s = lab_json(
        "infer",
        "--mode",
        "placement",
        "--nproc",
        "2",
        "--steps",
        "1",
        "--new-tokens",
        "4",
        "--prompts",
        "2",
        "--json",
    )
    assert checks_ok(s, "placement: greedy tokens") and s["matches_reference"]
    assert s["lab"] == "infer" and s["mode"] == "placement"
    assert (
        s["latency_per_token_s"] > 0
        and s["tokens_per_s"] > 0
        and s["theory_kv_cache_bytes_per_rank"]
    )

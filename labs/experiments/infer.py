"""Experiment 09: greedy generation with a KV cache on N ranks, tensor-parallel or with the layers
placed rank after rank, for the course model or a ``transformers`` Llama.

    summary = run(nproc=2, mode="tp")                       # notebook 09
    python -m labs.run infer --mode tp --nproc 4 --json
    python -m labs.run infer --mode placement --nproc 4 --model hf-llama --json
    python -m labs.run infer --mode both --nproc 2 --prompts 8 --new-tokens 24

Each rank builds the model from the seed (a ``LlamaForCausalLM`` is read into the course layout, as
the TP lab does) and generates for the same left-padded prompts: TP cuts it with
``apply_tensor_parallel`` (notebook 04), placement keeps the layers ``layers_on_stage`` gives its
stage (``build_stage``, notebook 05). One generation runs under the communication ledger (warm-up),
then ``steps`` timed ones. Checked three ways:

* reference: the tokens of every rank holding them equal, exactly, the single-process greedy tokens
  *without* a cache: the course model recomputes the whole sequence every step, each prompt alone
  and unpadded; a ``transformers`` Llama is checked against its own ``generate(do_sample=False)`` on
  the padded batch. Exactly on gloo; on GPUs by the tolerance table's "greedy_tokens" rule
  (``labs.train``): equal up to a first difference where the reference's two best logits were
  within a rounding's reach of each other;
* theory (``labs.theory.inference``): every rank's KV-cache bytes and weight bytes, and the
  collectives (or messages) of the prefill and of each decode step, op by op, with their payload and
  bytes sent;
* timing: the same generation on one rank (``single_*``), per-token latency (median time between two
  tokens), its 90th percentile, time to first token, tokens/s (B·new_tokens / time of a whole
  generation), and the latency model of ``per_token_latency`` fed with the measured single-rank
  latency and message time; ``vs_torch``: ``transformers``' ``generate`` on the same weights in one
  process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from labs.data import load_corpus
from labs.experiments import tp as tp_lab
from labs.experiments.common import COMM_HEADER, RunSummary, comm_row, course_spec, new_summary
from labs.experiments.spec import Bench, Lab, option
from labs.measure import CommLedger
from labs.measure.memory import param_bytes
from labs.measure.timing import StepTimer, time_steps
from labs.models.hf_convert import course_model_from
from labs.models.transformer import ModelConfig
from labs.runtime.device import one_thread, rank_device, synchronize
from labs.runtime.impl import exercise
from labs.runtime.launcher import launch, report_progress, under_torchrun
from labs.runtime.pipe import pipe_group
from labs.theory import inference as theory
from labs.theory.dims import ParallelDims, check_positive
from labs.theory.memory import layers_on_stage
from labs.train import tokens_agree

MODES = theory.MODES
MODELS = tp_lab.MODELS
# 4 layers: one per stage on 4 ranks; 4 kv heads: one per TP rank on 4
CONFIG = ModelConfig(n_layer=4)
MAX_PROMPT = 16  # longest prompt make_prompts cuts
LEDGER_OPS = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "isend": "send",
    "irecv": "recv",
}


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` byte-token prompts cut from the course corpus, 6 to MAX_PROMPT tokens long (different
    lengths)."""
    check_positive(prompts=n)
    corpus = load_corpus()
    starts = [
        ((i * (len(corpus) - MAX_PROMPT)) // n + 97 * seed) % (len(corpus) - MAX_PROMPT)
        for i in range(n)
    ]
    return [
        corpus[s : s + 6 + (5 * i + seed) % (MAX_PROMPT - 5)].tolist() for i, s in enumerate(starts)
    ]


def full_model(cfg: ModelConfig, model: str, seed: int) -> torch.nn.Module:
    """The unsharded model in eval mode: the course ``Transformer`` or a ``LlamaForCausalLM`` with
    its weights."""
    return tp_lab.full_model(cfg, model, seed).eval()


def stage_plan(n_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage, as the theory counts them (the first ``n_layers % stages`` stages take one
    more)."""
    return tuple(layers_on_stage(n_layers, stages, s) for s in range(stages))


# --- references, in the parent --------------------------------------------------------------------
class Greedy(NamedTuple):
    """A reference's greedy tokens [B, N] and, at each step, the gap between its two best logits
    as a fraction of the largest (``margins`` [B, N]): where a run on other hardware may pick the
    other token (``labs.train.tokens_agree``)."""

    tokens: torch.Tensor
    margins: torch.Tensor


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """(best - second best) / max |logit| over the last dim: [..., V] -> [...]."""
    top = logits.float().topk(2, dim=-1).values  # [..., 2]
    return (top[..., 0] - top[..., 1]) / logits.float().abs().amax(-1)


@torch.no_grad()
def no_cache_generation(model: torch.nn.Module, prompts, new_tokens: int) -> Greedy:
    """Greedy tokens [B, new_tokens] the plain way, each prompt alone, the whole sequence recomputed
    every step; with each step's top-two margin."""
    tokens = []
    margins = []
    for prompt in prompts:
        idx = torch.tensor([prompt])  # [1, T]
        gaps = []
        for _ in range(new_tokens):
            logits = model(idx)[:, -1]  # [1, V]
            gaps.append(top2_margin(logits))
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)  # [1, T+1]
        tokens.append(idx[0, len(prompt) :])
        margins.append(torch.cat(gaps))
    return Greedy(torch.stack(tokens), torch.stack(margins))


def no_cache_tokens(model: torch.nn.Module, prompts, new_tokens: int) -> torch.Tensor:
    """Greedy tokens [B, new_tokens] the plain way: each prompt alone, the whole sequence recomputed
    every step."""
    return no_cache_generation(model, prompts, new_tokens).tokens


@torch.no_grad()
def hf_generation(hf, prompts, new_tokens: int) -> Greedy:
    """``transformers``' greedy ``generate`` on the left-padded batch with its attention mask, and
    each step's top-two margin. No token ends a sequence: bytes have no end-of-sequence token
    (``LlamaConfig``'s default ``eos_token_id=2`` is byte 0x02, and ``min_new_tokens`` would instead
    forbid that byte)."""
    # left-padded to the longest prompt with pad id 0, here and not with the exercise's left_pad:
    # the reference shares no code with the learner's
    longest = max(len(p) for p in prompts)
    idx = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts])  # [B, T0]
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])  # [B, T0]
    out = hf.generate(
        input_ids=idx,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=[],
        output_logits=True,
        return_dict_in_generate=True,
    )
    margins = torch.stack([top2_margin(step) for step in out.logits], dim=1)  # [B, N]
    return Greedy(out.sequences[:, idx.shape[1] :], margins)


def hf_generate_tokens(hf, prompts, new_tokens: int) -> torch.Tensor:
    """``transformers``' greedy tokens [B, new_tokens] (``hf_generation``)."""
    return hf_generation(hf, prompts, new_tokens).tokens


# --- the worker -----------------------------------------------------------------------------------
def _message_seconds(mode: str, numel: int, repeats: int = 20) -> float:
    """Median time of one message of ``numel`` floats: an all-reduce (TP), or a hop of a pass around
    the ring of ranks (placement: the ring's time / N); ``repeats`` timed after a warm-up. 0 for
    the one-device baseline ("single")."""
    x = torch.zeros(numel, device=rank_device())
    n = dist.get_world_size()
    rank = dist.get_rank()
    if mode == "single":
        return 0.0  # the one-device baseline sends nothing

    def message():
        if n > 1 and mode == "tp":
            dist.all_reduce(x)
        elif n > 1:
            if rank != 0:
                dist.recv(x, (rank - 1) % n)
            dist.send(x, (rank + 1) % n)
            if rank == 0:
                dist.recv(x, n - 1)

    seconds = time_steps(message, repeats + 1, device=x.device)
    return seconds if mode == "tp" else seconds / n


def _timed(generate, timer: StepTimer) -> dict:
    """One generation, a step of ``timer``, with a clock read after every token: the time to the
    first token and the gaps between tokens."""
    stamps = []

    def tick(_):
        synchronize()
        stamps.append(time.perf_counter())

    with timer.step():
        start = time.perf_counter()
        generate(on_token=tick)
    return {"ttft": stamps[0] - start, "gaps": [b - a for a, b in zip(stamps, stamps[1:])]}


def infer_worker(model, prompts, new_tokens: int, mode: str, steps: int, hidden: int) -> dict:
    """One rank: build its part (``mode``: "tp", "placement" or "single"), generate once under the
    ledger (the warm-up step), then ``steps`` timed generations."""
    inference = exercise("inference")
    device = rank_device()
    rank = dist.get_rank()
    n = dist.get_world_size()
    model = model.to(device)
    if mode == "tp":
        # a course model or a transformers Llama
        part = exercise("tensor_parallel").apply_tensor_parallel(model)
        generate = partial(
            inference.generate, part, prompts, new_tokens=new_tokens, group=dist.group.WORLD
        )
    elif mode == "placement":
        pp = exercise("pipeline_parallel")
        full = course_model_from(model)
        part = pp.build_stage(full, plan=stage_plan(full.cfg.n_layer, n), stage=rank)
        generate = partial(
            inference.generate_placed, part, prompts, new_tokens=new_tokens, pipe=pipe_group()
        )
    else:
        part = course_model_from(model)
        generate = partial(inference.generate, part, prompts, new_tokens=new_tokens)
    timer = StepTimer(device)
    marks = [0]  # ledger records before each token's forward
    with timer.step(), CommLedger() as ledger:
        result = generate(on_token=lambda i: marks.append(len(ledger.records)))
    records = [(LEDGER_OPS.get(r.op, r.op), r.payload_bytes, r.sent_bytes) for r in ledger.records]
    # the prefill, then each decode step
    forwards = [records[a:b] for a, b in zip(marks, marks[1:])]
    timings = []
    for _ in range(steps):
        timings.append(_timed(generate, timer))
        report_progress()
    tokens = result.tokens.cpu() if result.tokens is not None else None
    return {
        "tokens": tokens,
        "kv_cache_bytes": result.cache.nbytes,
        "weight_bytes": param_bytes(part.parameters()),
        "prefill": forwards[0],
        "decode": forwards[1:],
        "timings": timings,
        "step_time_s": timer.step_time(),  # one whole generation
        "message_s": _message_seconds(mode, len(prompts) * hidden),
    }


def comm_table(records: list[tuple], forwards: int = 1) -> dict:
    """{op: {"calls", "payload_bytes", "sent_bytes"}} of ledger records, divided by ``forwards``."""
    out = {}
    for op, payload, sent in records:
        row = out.setdefault(op, {"calls": 0, "payload_bytes": 0, "sent_bytes": 0})
        row["calls"] += 1
        row["payload_bytes"] += payload
        row["sent_bytes"] += sent
    return {op: {k: v / forwards for k, v in row.items()} for op, row in out.items()}


# --- summaries ------------------------------------------------------------------------------------
def timing_summary(per_rank: list[dict], batch: int, new_tokens: int) -> dict:
    """Rank 0's clock (it waits for every rank each token): medians over the timed generations
    (the step time: a whole generation, by the course's rule)."""
    t = per_rank[0]["timings"]
    gaps = sorted(g for run_ in t for g in run_["gaps"])
    total = per_rank[0]["step_time_s"]
    return {
        "latency_per_token_s": statistics.median(gaps),
        "p90_latency_per_token_s": gaps[int(0.9 * (len(gaps) - 1))],
        "ttft_s": statistics.median(r["ttft"] for r in t),
        "step_time_s": total,
        "tokens_per_s": batch * new_tokens / total,
    }


def mode_summary(
    per_rank: list[dict],
    *,
    mode: str,
    nproc: int,
    spec,
    reference: Greedy,
    prompts,
    new_tokens: int,
    backend: str,
    single: dict | None = None,
) -> dict:
    """The figures of one mode's run, beside the theory and the single-rank baseline (whether they
    agree is its checks' to say: ``checks_of_mode``)."""
    batch = len(prompts)
    t0 = max(len(p) for p in prompts)
    holders = [r["tokens"] for r in per_rank if r["tokens"] is not None]
    s = {
        "mode": mode,
        "tokens": holders[0].tolist() if holders else None,
        "ranks_with_tokens": len(holders),
    }
    stages = nproc if mode == "placement" else 1
    tp = 1 if mode == "placement" else nproc
    kv = dict(batch=batch, seq=t0 + new_tokens, tp=tp, pp=stages, dtype_bytes=4)
    s["kv_cache_bytes_per_rank"] = [r["kv_cache_bytes"] for r in per_rank]
    s["theory_kv_cache_bytes_per_rank"] = [
        theory.kv_cache_bytes_per_rank(spec, stage=r if stages > 1 else 0, **kv)
        for r in range(nproc)
    ]
    s["weight_bytes_per_rank"] = [r["weight_bytes"] for r in per_rank]
    s["theory_weight_bytes_per_rank"] = theory.weight_bytes_per_rank(
        spec, mode=mode, degree=nproc, dtype_bytes=4
    )
    s["state_bytes_per_rank"] = [
        w + c for w, c in zip(s["weight_bytes_per_rank"], s["kv_cache_bytes_per_rank"])
    ]
    s["theory_state_bytes_per_rank"] = [
        w + c
        for w, c in zip(s["theory_weight_bytes_per_rank"], s["theory_kv_cache_bytes_per_rank"])
    ]
    comm = dict(mode=mode, degree=nproc, batch=batch, dtype_bytes=4)
    s["comm_prefill"] = [comm_table(r["prefill"]) for r in per_rank]
    s["theory_comm_prefill"] = theory.forward_comm(spec, tokens=t0, **comm)
    s["comm_decode"] = [
        comm_table([op for step in r["decode"] for op in step], new_tokens - 1)  # per decode step
        for r in per_rank
    ]
    s["theory_comm_decode"] = theory.forward_comm(spec, tokens=1, **comm)
    s["comm_bytes_per_rank"] = [
        sum(op["sent_bytes"] for op in c.values()) for c in s["comm_decode"]
    ]
    s["theory_comm_bytes_per_rank"] = [
        sum(op["sent_bytes"] for op in c.values()) for c in s["theory_comm_decode"]
    ]
    s["messages_per_token"] = theory.messages_per_forward(spec, mode=mode, degree=nproc)
    s.update(timing_summary(per_rank, batch, new_tokens))
    s["message_s"] = statistics.median(r["message_s"] for r in per_rank)
    if single is not None:
        # the latency model: the single rank's compute split N ways, plus the messages
        s["model_latency_per_token_s"] = theory.per_token_latency(
            compute_s=[single["latency_per_token_s"] / nproc] * nproc,
            mode=mode,
            messages=s["messages_per_token"],
            message_s=s["message_s"],
        )
        s["speedup_vs_single"] = single["latency_per_token_s"] / s["latency_per_token_s"]
    return s


def check_args(
    cfg: ModelConfig,
    *,
    nproc: int,
    mode: str,
    model: str,
    prompts: int,
    new_tokens: int,
    steps: int = 1,
) -> None:
    """Every ValueError ``run`` can raise, before any process starts."""
    if mode not in MODES + ("both",):
        raise ValueError(f"mode={mode!r} is not one of {MODES + ('both',)}")
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not one of {MODELS}")
    # steps: the timed generations after the warm-up one; the latencies are their medians
    check_positive(nproc=nproc, prompts=prompts, new_tokens=new_tokens, steps=steps)
    if new_tokens < 2:
        raise ValueError(
            f"new_tokens={new_tokens}: use new_tokens >= 2 (the first token is the prefill's; "
            "the lab times the decode steps after it)"
        )
    for m in MODES if mode == "both" else (mode,):
        if m == "tp":  # the lab's TP shards whole q and kv heads (no kv replication): checked first
            ParallelDims(tp=nproc).check_model(
                n_head=cfg.n_head,
                n_kv_head=cfg.n_kv_head,
                n_embd=cfg.n_embd,
                ffn_hidden=cfg.ffn_hidden,
                vocab_size=cfg.vocab_size,
            )
        theory.check(course_spec(cfg), mode=m, degree=nproc)
    if MAX_PROMPT + new_tokens > cfg.seq_len:
        raise ValueError(
            f"new_tokens={new_tokens}: prompts of up to {MAX_PROMPT} tokens plus new_tokens must"
            f" fit the model's seq_len={cfg.seq_len}; use new_tokens <= {cfg.seq_len - MAX_PROMPT}"
        )


@dataclass(frozen=True)
class Options:
    """The inference lab's options (``run``'s keywords, ``python -m labs.run infer``'s flags)."""

    mode: str = option(
        "tp",
        "tp: heads and cache split over ranks; placement: layers placed rank after rank",
        choices=MODES + ("both",),
    )
    prompts: int = option(4, "B: prompts generated together (6-16 tokens each)")
    new_tokens: int = option(16, "tokens generated per prompt")
    model: str = option("course", "the course model or a transformers Llama", choices=MODELS)
    seed: int = option(0)
    model_cfg: ModelConfig | None = option(None, command_line=False)  # default: CONFIG

    def check(self, *, nproc: int, steps: int, vs_torch: bool) -> None:
        check_args(
            self.model_cfg or CONFIG,
            nproc=nproc,
            mode=self.mode,
            model=self.model,
            prompts=self.prompts,
            new_tokens=self.new_tokens,
            steps=steps,
        )


LAB = Lab(
    name="infer",
    notebook="09_inference",
    exercises=("inference",),
    builds_on=("tensor_parallel", "pipeline_parallel"),
    reference=("full_model", "no_cache_generation", "hf_generation"),
    options=Options,
    ranks=2,
    small_run={"nproc": 2, "steps": 1, "mode": "tp", "prompts": 2, "new_tokens": 4},
    bench=(
        Bench(
            options={"mode": "tp"},
            torch="transformers generate, one process",
            like_for_like=False,
        ),
    ),
)


def run(
    *,
    nproc: int | None = None,
    steps: int = 3,
    backend: str = "auto",
    vs_torch: bool = False,
    timeout: float = 300.0,
    **options,
) -> RunSummary:
    """Generate ``new_tokens`` greedy tokens for ``prompts`` prompts on ``nproc`` ranks (default
    ``LAB.ranks``; ``mode``: "tp", "placement" or "both"; the ``options``: ``Options``) and on one,
    and check them; returns the lab summary (with "both", the per-mode figures are dicts keyed by
    mode and ``tp`` / ``placement`` hold each mode's summary)."""
    nproc = LAB.ranks if nproc is None else nproc
    o = LAB.parse(options, nproc=nproc, steps=steps, vs_torch=vs_torch)
    cfg = o.model_cfg or CONFIG
    batch = make_prompts(o.prompts, o.seed)
    full = full_model(cfg, o.model, o.seed)
    with one_thread():
        if o.model == "course":
            reference = no_cache_generation(full, batch, o.new_tokens)
            reference_name = "no cache, each prompt alone"
        else:
            reference = hf_generation(full, batch, o.new_tokens)
            reference_name = "transformers generate"
    job = partial(launch, infer_worker, backend=backend, timeout=timeout, progress=steps)
    # The one-device baseline: a launch of its own rank, or, in a torchrun job (whose ranks are
    # fixed), computed by every rank on its own device; rank 0's is the figure.
    single_ranks = nproc if under_torchrun() else 1
    one = job(single_ranks, full, batch, o.new_tokens, "single", steps, cfg.n_embd, desc="1 rank")
    single = mode_summary(
        one[:1],
        mode="tp",
        nproc=1,
        spec=course_spec(cfg),
        reference=reference,
        prompts=batch,
        new_tokens=o.new_tokens,
        backend=one.backend,
    )
    per_mode = {}
    mode_checks = {}
    for m in MODES if o.mode == "both" else (o.mode,):
        per_rank = job(
            nproc, full, batch, o.new_tokens, m, steps, cfg.n_embd, desc=f"{m} on {nproc} ranks"
        )
        mode_checks[m] = checks_of_mode(
            per_rank,
            mode=m,
            spec=course_spec(cfg),
            reference=reference,
            prompts=batch,
            new_tokens=o.new_tokens,
            backend=per_rank.backend,
            prefix=f"{m}: ",
        )
        per_mode[m] = mode_summary(
            per_rank,
            mode=m,
            nproc=nproc,
            spec=course_spec(cfg),
            reference=reference,
            prompts=batch,
            new_tokens=o.new_tokens,
            backend=per_rank.backend,
            single=single,
        )
    s = new_summary(
        "infer",
        nproc=nproc,
        backend=per_rank.backend,
        steps=steps,
        mode=o.mode,
        model=o.model,
        prompts=o.prompts,
        new_tokens=o.new_tokens,
        reference=reference_name,
        prompt_lengths=[len(p) for p in batch],
        single_latency_per_token_s=single["latency_per_token_s"],
        single_tokens_per_s=single["tokens_per_s"],
        single_kv_cache_bytes=single["kv_cache_bytes_per_rank"][0],
    )
    if vs_torch:
        from labs.models.hf import to_hf_llama

        hf = full if o.model == "hf-llama" else to_hf_llama(full)

        def torch_generation():
            hf_generate_tokens(hf, batch, o.new_tokens)

        with one_thread():  # a warm-up generation, then ``steps`` timed, as ours
            s["torch_step_time_s"] = time_steps(torch_generation, steps + 1)
        s["torch_tokens_per_s"] = o.prompts * o.new_tokens / s["torch_step_time_s"]
    s.add_checks(
        [tokens_check(one[:1], reference, name="one rank: greedy tokens", backend=one.backend)]
    )
    for checks in mode_checks.values():
        s.add_checks(checks)
    if o.mode != "both":
        s.update(per_mode[o.mode])
        s["mode"] = o.mode
        return s
    s.update(per_mode)
    for key in (
        "latency_per_token_s",
        "tokens_per_s",
        "kv_cache_bytes_per_rank",
        "theory_kv_cache_bytes_per_rank",
        "comm_bytes_per_rank",
        "theory_comm_bytes_per_rank",
        "state_bytes_per_rank",
        "theory_state_bytes_per_rank",
        "step_time_s",
    ):
        s[key] = {m: v[key] for m, v in per_mode.items()}
    return s


# --- the verdict ----------------------------------------------------------------------------------
PREFILL_HINT = (
    "the first token (the prefill's) differs: the prompt's forward. Check the attention mask (no "
    "key after the query's slot, none on a left pad), that the logits are the last slot's, and "
    "under TP the greedy pick: the global id of a rank's best logit is r·V/tp + its local id"
)
DECODE_HINT = (
    "the tokens agree up to step {i} and then part: the decode steps. Each feeds the previous "
    "token at the next slot (start advances by the tokens fed: T0 after the prefill, then 1), and "
    "the cache must return every earlier slot's K and V"
)


def tokens_check(per_rank: list[dict], reference, *, name: str, backend: str):
    """The greedy tokens of every rank that holds them against the reference, by the tolerance
    table's "greedy_tokens" rule; a failure names the rank, prompt and step where they part."""
    from labs.experiments.checks import Check

    holders = [(i, r["tokens"]) for i, r in enumerate(per_rank) if r["tokens"] is not None]
    if not holders:
        return Check(
            name,
            False,
            "no rank",
            "tokens",
            hint="no rank returned the tokens",
            against="reference",
        )
    for rank, tokens in holders:
        if tokens_agree(tokens, reference.tokens, reference.margins, backend=backend):
            continue
        if tokens.shape != reference.tokens.shape:
            return Check(
                name,
                False,
                list(tokens.shape),
                list(reference.tokens.shape),
                where=f"rank {rank}",
                hint="the tokens are [B, new_tokens]: one per prompt per step",
                against="reference",
            )
        b, i = (tokens != reference.tokens).nonzero()[0].tolist()
        return Check(
            name,
            False,
            tokens[b, : i + 1].tolist(),
            reference.tokens[b, : i + 1].tolist(),
            where=f"rank {rank}, prompt {b}, token {i}",
            hint=PREFILL_HINT if i == 0 else DECODE_HINT.format(i=i),
            against="reference",
        )
    return Check(
        name,
        True,
        "equal",
        "the reference's",
        where=f"{len(holders)} ranks, {tuple(reference.tokens.shape)}",
        against="reference",
    )


def _per_call(rows: dict) -> list[tuple[str, float]]:
    """(op, payload) of every call of a theory row {op: {"calls", "payload_bytes", ...}}."""
    return [
        (op, row["payload_bytes"] / row["calls"])
        for op, row in rows.items()
        for _ in range(int(row["calls"]))
    ]


def checks_of_mode(
    per_rank: list[dict],
    *,
    mode: str,
    spec,
    reference,
    prompts,
    new_tokens: int,
    backend: str,
    prefix: str = "",
) -> list:
    """One mode's checks on every rank: the tokens, the messages of the prefill and of every decode
    step call by call (payload bytes), KV-cache and weight bytes."""
    from labs.experiments.checks import Check, collectives_checks, compare_values

    nproc = len(per_rank)
    batch = len(prompts)
    t0 = max(len(p) for p in prompts)
    comm = dict(mode=mode, degree=nproc, batch=batch, dtype_bytes=4)
    prefill = theory.forward_comm(spec, tokens=t0, **comm)
    decode = theory.forward_comm(spec, tokens=1, **comm)
    expected = [
        [("prefill", op, b) for op, b in _per_call(prefill[r])]
        + [("decode", op, b) for op, b in _per_call(decode[r])] * (new_tokens - 1)
        for r in range(nproc)
    ]
    measured = [
        [("prefill", op, payload) for op, payload, _ in r["prefill"]]
        + [("decode", op, payload) for step in r["decode"] for op, payload, _ in step]
        for r in per_rank
    ]
    holders = [i for i, r in enumerate(per_rank) if r["tokens"] is not None]
    want = list(range(nproc)) if mode == "tp" else sorted({0, nproc - 1})
    checks = [
        tokens_check(per_rank, reference, name=f"{prefix}greedy tokens", backend=backend),
        Check(
            f"{prefix}ranks returning the tokens",
            holders == want,
            holders,
            want,
            hint="TP: every rank computes every token; placement: the first stage (it embeds "
            "them next) and the last (it picks them) hold the tokens, the others return None",
        ),
    ]
    checks += collectives_checks(
        measured,
        expected,
        world_size=nproc,
        count_hint="the {phase} forward issued another number of {op} calls than the theory: "
        "TP, 2L + 1 all-reduces (the embedding's g, o_proj's and down_proj's per layer) and "
        "one all-gather of each rank's best (logit, id); placement, one send and one receive "
        "per stage",
        prefix=prefix,
    )
    kv = dict(
        batch=batch, seq=t0 + new_tokens, tp=1 if mode == "placement" else nproc, dtype_bytes=4
    )
    stages = nproc if mode == "placement" else 1
    checks += [
        compare_values(
            f"{prefix}KV-cache bytes per rank",
            [r["kv_cache_bytes"] for r in per_rank],
            [
                theory.kv_cache_bytes_per_rank(spec, stage=r if stages > 1 else 0, pp=stages, **kv)
                for r in range(nproc)
            ],
            hint="a rank's cache holds K and V of its own layers and heads (TP: nkv/tp heads), "
            "for T0 + new_tokens slots",
            world_size=nproc,
        ),
        compare_values(
            f"{prefix}weight bytes per rank",
            [r["weight_bytes"] for r in per_rank],
            theory.weight_bytes_per_rank(spec, mode=mode, degree=nproc, dtype_bytes=4),
            hint="TP: 1/tp of every matrix, the norms whole; placement: the stage's layers",
            world_size=nproc,
        ),
    ]
    return checks


# --- notebook 09's views --------------------------------------------------------------------------
def single_process_check(*, prompts: int = 4, new_tokens: int = 16, seed: int = 0) -> dict:
    """One process, the course model: the cached batched generation against recomputing without a
    cache (each prompt alone), against the same generation of each prompt alone, and against
    ``transformers``' ``generate`` on the same weights; the cache's bytes against the theory."""
    from labs.models.hf import to_hf_llama

    inference = exercise("inference")
    model = full_model(CONFIG, "course", seed)
    batch = make_prompts(prompts, seed)
    with one_thread():
        ours = inference.generate(model, batch, new_tokens=new_tokens)
        alone = torch.cat(
            [inference.generate(model, [p], new_tokens=new_tokens).tokens for p in batch]
        )
        no_cache = no_cache_tokens(model, batch, new_tokens)
        hf = hf_generate_tokens(to_hf_llama(model), batch, new_tokens)
    seq = max(len(p) for p in batch) + new_tokens
    return {
        "prompts": [bytes(p).decode(errors="replace") for p in batch],
        "tokens": ours.tokens.tolist(),
        "equals_no_cache": torch.equal(ours.tokens, no_cache),
        "equals_each_prompt_alone": torch.equal(ours.tokens, alone),
        "equals_transformers_generate": torch.equal(ours.tokens, hf),
        "kv_cache_bytes": ours.cache.nbytes,
        "theory_kv_cache_bytes": theory.kv_cache_bytes_per_rank(
            course_spec(CONFIG), batch=prompts, seq=seq, dtype_bytes=4
        ),
    }


def _modes(summary: RunSummary) -> dict:
    return (
        {m: summary[m] for m in MODES if m in summary}
        if summary["mode"] == "both"
        else {summary["mode"]: summary}
    )


def comm_report(summary: RunSummary) -> str:
    """Each rank's messages in the prefill and per decode step, measured by the ledger beside the
    theory."""
    lines = [f"{'mode':<10}{'rank':>5} {'phase':<8}{'op':<11}{COMM_HEADER}"]
    for mode, s in _modes(summary).items():
        for rank in range(summary["nproc"]):
            for phase in ("prefill", "decode"):
                got = s[f"comm_{phase}"][rank]
                want = s[f"theory_comm_{phase}"][rank]
                for op in sorted(set(got) | set(want)):
                    lines.append(
                        f"{mode:<10}{rank:>5} {phase:<8}{op:<11}"
                        + comm_row(got.get(op, {}), want.get(op, {}))
                    )
    return "\n".join(lines)


def memory_report(runs: list[RunSummary]) -> str:
    """KV-cache and weight bytes per rank of each run and mode, measured beside the theory."""
    lines = [
        f"{'mode':<10}{'ranks':>6}  {'KV cache bytes per rank (theory)':<44}"
        "weight bytes per rank (theory)"
    ]
    for summary in runs:
        for mode, s in _modes(summary).items():
            kv = ", ".join(f"{m}" for m in s["kv_cache_bytes_per_rank"])
            same = s["kv_cache_bytes_per_rank"] == s["theory_kv_cache_bytes_per_rank"]
            w_same = s["weight_bytes_per_rank"] == s["theory_weight_bytes_per_rank"]
            kv_cell = kv + (" (=)" if same else " (differs)")
            weights = ", ".join(map(str, s["weight_bytes_per_rank"]))
            lines.append(
                f"{mode:<10}{summary['nproc']:>6}  {kv_cell:<44}"
                f"{weights}{' (=)' if w_same else ' (differs)'}"
            )
    return "\n".join(lines)

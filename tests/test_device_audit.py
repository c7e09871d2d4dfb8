"""The device contract, proven on CPU: under the device audit (``labs.runtime.audit``) each rank's
device is a stand-in that is not the host's, and every lab, every notebook-10 scenario and
``scripts/gpu_check.py``'s own workers run without handing a CPU tensor to ``torch.distributed``,
to torch's DDP, FSDP2 or pipelining, or to an operation on the rank's device: what NCCL on GPUs
requires. The audit itself fails on a stray CPU tensor, naming the op, the lab and the line.

Each lab runs as ``python -m labs.run LAB`` does (``labs.run.main``), in this process: its ranks
are forked with the audit switched on, 2 steps on 2 ranks (4 where a lab's N=4 path differs).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist

from labs import launch
from labs.experiments.spec import command_labs
from labs.run import main as run_lab
from labs.runtime import RankError
from labs.runtime.audit import AUDIT_ENV, AUDIT_LOG_ENV, DeviceAuditError
from labs.runtime.device import ddp_device_ids, rank_device
from labs.train import BACKENDS, TOLERANCE_TABLE, rule, tokens_agree, within


@pytest.fixture
def audit(monkeypatch):
    """The audit on for every rank launched in the test (the ranks inherit the environment)."""
    monkeypatch.setenv(AUDIT_ENV, "1")
    monkeypatch.delenv(AUDIT_LOG_ENV, raising=False)


# --- the audit fails on a stray CPU tensor -------------------------------------------------------
def all_reduce_a_host_tensor():
    x = torch.zeros(4)  # the bug: made on the host, not on rank_device()
    dist.all_reduce(x)


def host_batch_into_the_model():
    model = torch.nn.Linear(4, 4).to(rank_device())
    return model(torch.ones(2, 4)).sum().item()  # the bug: the batch stayed on the host


def host_tensor_from_the_launching_process(t):
    dist.broadcast(t, 0)  # the bug: a tensor made before the ranks started


def torch_ddp_without_device_ids():
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(torch.nn.Linear(4, 4).to(rank_device()))


def fsdp2_of_a_host_module():
    from torch.distributed.fsdp import fully_shard

    fully_shard(torch.nn.Linear(4, 4))


def monitored_barrier_on_a_gpu_backend():
    dist.monitored_barrier()


def host_tensor_in_a_gradient_hook():
    p = torch.nn.Parameter(torch.ones(3, device=rank_device()))
    p.register_post_accumulate_grad_hook(lambda _: dist.all_reduce(torch.zeros(3)))
    (2 * p).sum().backward()


def everything_on_the_device():
    """What a lab does right: no finding."""
    from torch.nn.parallel import DistributedDataParallel

    device = rank_device()
    model = DistributedDataParallel(
        torch.nn.Linear(4, 4).to(device), device_ids=ddp_device_ids(device)
    )
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).to(device)
    model(x).sum().backward()
    buffer = torch.zeros(4, device=model.module.weight.device)  # .device reads as the rank's
    dist.all_reduce(buffer)
    return str(device), str(buffer.device), model.module.weight.grad.shape


def test_the_audit_names_the_op_the_lab_and_the_line(audit):
    with pytest.raises(RankError) as info:
        launch(all_reduce_a_host_tensor, 2, timeout=60)
    message = str(info.value)
    assert info.value.exc_type == DeviceAuditError.__name__
    assert "dist.all_reduce() got a CPU tensor (4,) torch.float32" in message
    assert f"lab {__name__} ({__name__}.all_reduce_a_host_tensor)" in message
    line = all_reduce_a_host_tensor.__code__.co_firstlineno
    assert f"made at tests/test_device_audit.py:{line + 1}" in message  # torch.zeros(4)
    assert f"called from tests/test_device_audit.py:{line + 2}" in message  # dist.all_reduce


@pytest.mark.parametrize(
    "bug, args, expected",
    [
        (host_batch_into_the_model, (), "linear() mixes a device tensor with a CPU tensor (2, 4)"),
        (
            host_tensor_from_the_launching_process,
            (torch.ones(3),),
            "dist.broadcast() got a CPU tensor (3,) torch.float32 (made before the rank started",
        ),
        (torch_ddp_without_device_ids, (), "DistributedDataParallel got no device_ids"),
        (fsdp2_of_a_host_module, (), "fully_shard got a module whose weight is on the CPU"),
        (monitored_barrier_on_a_gpu_backend, (), "monitored_barrier exists only on gloo"),
        (host_tensor_in_a_gradient_hook, (), "dist.all_reduce() got a CPU tensor (3,)"),
    ],
)
def test_the_audit_catches_each_kind_of_stray_tensor(audit, bug, args, expected):
    with pytest.raises(RankError) as info:
        launch(bug, 2, *args, timeout=60)
    assert info.value.exc_type == DeviceAuditError.__name__ and expected in str(info.value)


def test_the_audit_passes_device_code_and_is_off_unless_asked(audit, monkeypatch):
    assert launch(everything_on_the_device, 2, timeout=60) == [
        ("cpu:0", "cpu:0", torch.Size([4, 4])),
        ("cpu:1", "cpu:1", torch.Size([4, 4])),
    ]
    # a launch that forces gloo runs on the CPU for real: nothing to audit
    launch(monitored_barrier_on_a_gpu_backend, 2, backend="gloo", timeout=60)
    monkeypatch.delenv(AUDIT_ENV)
    launch(all_reduce_a_host_tensor, 2, timeout=60)  # the audit is off: gloo takes it


def test_the_log_mode_lists_findings_and_lets_the_run_go_on(audit, monkeypatch, tmp_path):
    log = tmp_path / "audit.log"
    monkeypatch.setenv(AUDIT_LOG_ENV, str(log))
    launch(all_reduce_a_host_tensor, 2, timeout=60)
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and all("dist.all_reduce() got a CPU tensor" in x for x in lines)


def test_the_audit_costs_seconds_not_minutes(audit):
    """Overhead: an audited 2-rank, 2-step DDP run takes a few seconds, as an unaudited one."""
    t0 = time.perf_counter()
    assert run_lab(["ddp", "--nproc", "2", "--steps", "2", "--impl", "solutions"]) == 0
    assert time.perf_counter() - t0 < 30


# --- every lab, scenario and gpu_check worker passes it ------------------------------------------
# labs.run's arguments: each lab at 2 ranks, and its modes that run other code.
LAB_RUNS = {
    "collectives": ["collectives", "--vs-torch"],
    "memory": ["memory"],
    "ddp": ["ddp", "--variant", "all", "--vs-torch"],
    "ddp-awkward": ["ddp", "--model", "awkward", "--grad-accum", "2"],
    "ddp-bf16-mixed": ["ddp", "--variant", "all", "--precision", "bf16-mixed", "--vs-torch"],
    "ddp-fp16-mixed": ["ddp", "--variant", "overlapped", "--precision", "fp16-mixed"],
    "zero-1": ["zero", "--stage", "1"],
    "zero-2-offload": ["zero", "--stage", "2", "--offload"],
    "zero-3-fsdp2": ["zero", "--stage", "3", "--vs-torch"],
    "zero-0-bf16-mixed": ["zero", "--stage", "0", "--precision", "bf16-mixed"],
    "zero-2-fp16-mixed": ["zero", "--stage", "2", "--precision", "fp16-mixed"],
    "zero-3-bf16-fsdp2": ["zero", "--stage", "3", "--precision", "bf16-mixed", "--vs-torch"],
    "tp": ["tp", "--vs-torch"],
    "tp-sp": ["tp", "--sp"],
    "tp-hf-llama": ["tp", "--model", "hf-llama"],
    "tp-async": ["tp", "--async-linear", "--op-time", "0.001"],
    "tp-sp-async": ["tp", "--sp", "--async-linear"],
    "pp-naive": ["pp", "--schedule", "naive", "--op-time", "0"],
    "pp-gpipe": ["pp", "--schedule", "gpipe", "--op-time", "0"],
    "pp-1f1b-pipelining": ["pp", "--schedule", "1f1b", "--op-time", "0", "--vs-torch"],
    "pp-interleaved": ["pp", "--schedule", "interleaved", "--op-time", "0"],
    "pp-zb-h1-pipelining": ["pp", "--schedule", "zb-h1", "--op-time", "0", "--vs-torch"],
    "pp-dualpipev": ["pp", "--schedule", "dualpipev", "--op-time", "0", "--vs-torch"],
    "cp": ["cp", "--vs-torch"],
    "moe": ["moe", "--vs-torch"],
    "mesh-tp-pp": ["mesh", "--nproc", "4", "--tp", "2", "--pp", "2"],
    "mesh-dp-cp-zero3": ["mesh", "--nproc", "4", "--dp", "2", "--cp", "2", "--zero", "3"],
    "infer": ["infer", "--mode", "both"],
    "infer-hf-llama": ["infer", "--mode", "both", "--model", "hf-llama"],
    "multimodal-pp-timeline": ["multimodal", "--mode", "pp", "--timed-steps", "1"],
    "multimodal-dp": ["multimodal", "--mode", "dp", "--vs-torch"],
    "multimodal-tp": ["multimodal", "--mode", "tp"],
}


def test_every_lab_is_in_the_audit():
    assert {argv[0] for argv in LAB_RUNS.values()} == set(command_labs())


@pytest.mark.slow
@pytest.mark.parametrize("name", LAB_RUNS)
def test_lab_passes_the_device_audit(audit, capsys, name):
    argv = LAB_RUNS[name]
    nproc = [] if "--nproc" in argv else ["--nproc", "2"]
    code = run_lab([*argv, *nproc, "--steps", "2", "--json", "--impl", "solutions"])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["matches_reference"] is True and summary["passed"] is True, summary


@pytest.mark.slow
def test_the_labs_other_launches_pass_the_device_audit(audit, tmp_path):
    """What notebooks launch besides ``run``: the DDP timeline, notebook 04's operators, layers
    and async linear, notebook 06's attention check and memory scaling, the MoE layer, the
    checkpoint demo (DCP) and the bandwidth sweep."""
    from labs.experiments import collectives, cp, ddp_timeline, moe, tp_parts, zero_checkpoint

    assert ddp_timeline.measure_overlap(nproc=2, steps=2)["per_rank"]
    assert tp_parts.check_operators(nproc=2)
    assert tp_parts.check_layers(nproc=2, sp=True)
    assert tp_parts.check_async_linear(nproc=2, sp=True)
    assert all(r["matches_reference"] for r in cp.attention_check(nproc=2))
    assert cp.memory_scaling(cps=(1, 2))
    assert moe.layer_check(ep=2)
    demo = zero_checkpoint.checkpoint_demo(tmp_path, save_nproc=4, load_nproc=2, steps=1)
    assert demo["resume_on_4_exact"] and demo["load_on_2_exact"]
    assert collectives.bandwidth_sweep(nproc=2, sizes=[1024], repeats=1)["rows"]


@pytest.mark.slow
def test_notebook_10_scenarios_pass_the_device_audit(audit):
    """Each scenario still fails the way it should (and not with a DeviceAuditError); the ones in
    ``GLOO_ONLY`` force gloo, which the audit leaves alone."""
    from labs.experiments import failures

    for name in failures.SCENARIOS:
        report = failures.diagnose(name)
        assert report["error"] is not None and "DeviceAudit" not in report["message"], report
    result = failures.straggler_timeline(nproc=2, steps=2, work=64)
    assert result["events"]


@pytest.mark.slow
def test_gpu_check_workers_pass_the_device_audit(audit):
    from scripts import gpu_check

    rows = gpu_check.measure_throughput(
        list(gpu_check.MODE_NAMES),
        cfg=gpu_check.model_config(tiny=True),
        world=2,
        backend="auto",  # gpu_check asks for NCCL on GPUs: audited like it
        micro_batch=2,
        predict_memory=False,
        peak=1e12,
        steps=2,
        timeout=120,
        deadline=time.monotonic() + 600,
        log=lambda _: None,
    )
    assert [(r["mode"], r["status"]) for r in rows] == [
        (mode, "ok") for mode in gpu_check.MODE_NAMES
    ], rows


# --- numerics on GPUs: the one tolerance table ----------------------------------------------------
def test_every_quantity_has_a_rule_per_backend_with_a_reason():
    quantities = {q for q, _, _ in TOLERANCE_TABLE}
    for q, dtype, _ in TOLERANCE_TABLE:
        for backend in BACKENDS:
            r = rule(q, dtype, backend)
            assert r.why and r.rel >= 0
    # what is bit for bit on CPU: exact on gloo; on GPUs exact only with deterministic kernels
    for q in ("zero_stages", "same_ops", "replicas", "rerun", "greedy_tokens"):
        assert q in quantities and rule(q, None, "gloo").rel == 0.0
        gpu = rule(q, None, "nccl")
        assert gpu.rel > 0.0 or gpu.deterministic, q
    assert rule("value", torch.float32, "nccl").rel == 1e-5
    assert within("same_ops", 0.0) and not within("same_ops", 1e-9)
    assert within("same_ops", 1e-9, backend="nccl")
    with pytest.raises(ValueError, match="quantity='nope'"):
        rule("nope")
    with pytest.raises(ValueError, match="backend='mpi'"):
        rule("value", torch.float32, "mpi")


def test_greedy_tokens_may_part_only_at_a_near_tie_on_gpus():
    reference = torch.tensor([[5, 6, 7, 8]])
    margins = torch.tensor([[0.5, 1e-6, 0.5, 0.5]])  # step 1 is a near-tie
    parted_at_the_tie = torch.tensor([[5, 9, 1, 2]])
    parted_elsewhere = torch.tensor([[5, 6, 9, 8]])
    assert tokens_agree(reference.clone(), reference, margins, backend="gloo")
    assert not tokens_agree(parted_at_the_tie, reference, margins, backend="gloo")
    assert tokens_agree(parted_at_the_tie, reference, margins, backend="nccl")
    assert not tokens_agree(parted_elsewhere, reference, margins, backend="nccl")

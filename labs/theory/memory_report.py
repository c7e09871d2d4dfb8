"""The memory calculator's reports, shared by the command line and the widget
(``labs.widgets.memory``): a model from a preset or free dimensions, the fits / does-not-fit
verdict, sweeps, comparisons and tables, and ``report``, what ``python -m labs.theory memory``
prints (the command line itself is ``labs.theory.cli``). Pure Python.

    python -m labs.theory memory --preset llama3-8b --seq 4096 --mbs 1 --zero 3 --dp 8 \\
        --gpu-mem 80
    python -m labs.theory memory --layers 2 --hidden 64 --heads 8 --kv-heads 4 --ffn 128 \\
        --vocab 256 --seq 32 --mbs 8 --precision fp32 --json

Dimensions given with a preset override the preset's (``--experts 8 --top-k 2`` turns a
preset's MLPs into a mixture of experts; ``--ep`` spreads them). Memory is in GiB (2^30 bytes)
everywhere, and ``--gpu-mem`` is GiB too: ``--gpu-mem 79.6`` (an H100 "80 GB", as nvidia-smi
reports it), or with a unit, ``--gpu-mem 79.6GiB`` or ``--gpu-mem 80GB`` (decimal, converted).
Bad input (a degree that does not divide the heads, more stages than layers, ZeRO without DP,
...) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from labs.theory.activations import layer_terms, playbook_layer_bytes, terms_bytes
from labs.theory.dims import check_positive
from labs.theory.flops import flops_per_token, mfu
from labs.theory.memory import (
    GIB,
    OPTIMIZERS,
    PRECISIONS,
    ModelSpec,
    fits,
    memory_per_rank,
    param_count,
    state_bytes,
)
from labs.theory.presets import PRESETS
from labs.theory.presets import preset as get_preset

# CLI / widget name -> ModelSpec field
DIMS = {
    "layers": "n_layers",
    "hidden": "hidden",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn": "ffn_hidden",
    "vocab": "vocab_size",
    "head_dim": "head_dim",
    "experts": "n_experts",
    "top_k": "top_k",
}
RUN_KEYS = ("seq", "mbs", *memory_per_rank.__kwdefaults__)  # the keywords of memory_per_rank


def model_spec(
    preset: str | None = None,
    *,
    arch: str | None = None,
    tied: bool | None = None,
    **dims: int | None,
) -> tuple[str, ModelSpec]:
    """(name, spec) for a preset with optional overrides, or for free dimensions
    (``layers``, ``hidden``, ``heads``, ``vocab`` required; ``kv_heads``, ``ffn``, ``head_dim``,
    ``experts``, ``top_k`` optional)."""
    unknown = sorted(set(dims) - set(DIMS))
    if unknown:
        raise ValueError(f"unknown model dimension(s) {unknown}; choose from {tuple(DIMS)}")
    given = {name: value for name, value in dims.items() if value is not None}
    check_positive(**given)
    fields = {DIMS[name]: value for name, value in given.items()}
    fields.update({k: v for k, v in (("arch", arch), ("tied_embeddings", tied)) if v is not None})
    if preset is not None:
        return preset, dataclasses.replace(get_preset(preset), **fields)
    missing = [f"--{n}" for n in ("layers", "hidden", "heads", "vocab") if n not in given]
    if missing:
        raise ValueError(
            f"give --preset NAME or the model's dimensions; missing {', '.join(missing)}"
        )
    return "custom", ModelSpec(**fields)


def spec_dims(spec: ModelSpec) -> dict:
    """The free dimensions (CLI / widget names) that rebuild ``spec`` with ``model_spec``."""
    return {
        "layers": spec.n_layers,
        "hidden": spec.hidden,
        "heads": spec.n_heads,
        "kv_heads": spec.kv_heads,
        "ffn": spec.ffn,
        "vocab": spec.vocab_size,
        "head_dim": spec.hd,
        "experts": spec.n_experts,
        "top_k": spec.top_k,
        "arch": spec.arch,
        "tied": spec.tied_embeddings,
    }


def gpu_memory_gib(text: str | float) -> float:
    """GPU memory in GiB from a number (GiB) or a number with a unit: ``79.6``, ``79.6GiB``,
    ``80GB`` (decimal gigabytes, 10^9 bytes: 74.5 GiB). The one unit rule: memory in GiB."""
    raw = str(text).strip()
    units = {"gib": 1.0, "gb": 1e9 / GIB}
    unit = next((u for u in units if raw.lower().endswith(u)), None)
    number = raw[: len(raw) - len(unit)].strip() if unit else raw
    try:
        value = float(number) * units.get(unit, 1.0)
    except ValueError:
        raise ValueError(
            f"gpu_mem={text!r} is not a number of GiB; give e.g. 79.6, 79.6GiB or 80GB"
        ) from None
    if not value > 0:
        raise ValueError(f"gpu_mem must be > 0 GiB, got {text!r}")
    return value


def verdict(total_bytes: float, gpu_mem_gib: float) -> str:
    """One line: 'fits: ...' or 'does not fit: ...' with the numbers."""
    word = "fits" if fits(total_bytes, gpu_mem_gib) else "does not fit"
    share = total_bytes / (gpu_mem_gib * GIB)
    return f"{word}: {total_bytes / GIB:.1f} GiB of {gpu_mem_gib:.1f} GiB per GPU ({share:.0%})"


def sweep(spec: ModelSpec, param: str, values: Iterable, **run: object) -> list[dict]:
    """``memory_per_rank`` for each of ``values`` of one keyword (``seq``, ``dp``, ``tp``, ...);
    a value the layout rejects gives a row with ``error`` instead of the byte counts."""
    if param not in RUN_KEYS:
        raise ValueError(f"param={param!r} is not one of {RUN_KEYS}")
    rows = []
    for value in values:
        try:
            rows.append({"value": value, **memory_per_rank(spec, **{**run, param: value})})
        except ValueError as e:
            rows.append({"value": value, "error": str(e)})
    return rows


def evaluate(
    *, preset: str | None, dims: dict | None = None, gpu_mem_gib: float, **run: object
) -> dict:
    """Everything the widget shows for one setting of its controls: ``name``, ``spec``,
    ``result`` (``memory_per_rank``), ``verdict`` text, or ``error`` (then ``result`` is None
    and the verdict says why nothing was computed)."""
    try:
        name, spec = model_spec(preset, **(dims or {}))
        result = memory_per_rank(spec, **run)
        return {
            "name": name,
            "spec": spec,
            "result": result,
            "error": None,
            "verdict": verdict(result["total_bytes"], gpu_mem_gib),
        }
    except ValueError as e:
        return {
            "name": preset,
            "spec": None,
            "result": None,
            "error": str(e),
            "verdict": f"cannot compute: {e}",
        }


def bytes_per_param_table() -> str:
    """Training-state bytes per parameter for each precision and optimizer (no ZeRO)."""
    lines = [
        f"{'precision':<30}{'optimizer':<14}{'params':>7}{'grads':>7}{'optimizer':>10}{'total':>7}"
    ]
    for precision, accum in (("fp32", False), ("bf16-mixed", False), ("bf16-mixed", True)):
        for optimizer in OPTIMIZERS:
            if optimizer == "adam":
                continue  # the same state as adamw
            b = state_bytes(1, precision=precision, optimizer=optimizer, fp32_grad_accum=accum)
            label = precision + (" + fp32 grad accum" if accum else "")
            lines.append(
                f"{label:<30}{optimizer:<14}{b['param_bytes']:>7}{b['grad_bytes']:>7}"
                f"{b['optimizer_bytes']:>10}{b['total_bytes']:>7}"
            )
    return "\n".join(lines)


def compare(spec: ModelSpec, configs: dict[str, dict], **common: object) -> list[dict]:
    """``memory_per_rank`` for named configurations (each a dict of keywords added to ``common``),
    as rows like ``sweep``'s with the name as ``value``."""
    rows = []
    for name, config in configs.items():
        seq = config.get("seq", common.get("seq"))
        (row,) = sweep(spec, "seq", [seq], **{**common, **config})
        rows.append({**row, "value": name})
    return rows


def format_rows(rows: list[dict], gpu_mem_gib: float | None = None, label: str = "") -> str:
    """A table of ``sweep`` / ``compare`` rows: GiB per rank by part, and the verdict for
    ``gpu_mem_gib``."""
    width = max([len(label)] + [len(str(r["value"])) for r in rows]) + 2
    head = f"{label:<{width}}" + "".join(
        f"{h:>13}" for h in ("params", "grads", "optimizer", "activations", "total")
    )
    lines = [
        head + (f"   on {gpu_mem_gib:.1f} GiB" if gpu_mem_gib else ""),
        f"{'':<{width}}{'(GiB per rank)':>65}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{str(r['value']):<{width}}  invalid: {r['error']}")
            continue
        parts = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "total_bytes")
        cells = "".join(f"{r[k] / GIB:>13.2f}" for k in parts)
        line = f"{str(r['value']):<{width}}{cells}"
        if gpu_mem_gib:
            line += "   fits" if fits(r["total_bytes"], gpu_mem_gib) else "   does not fit"
        lines.append(line)
    return "\n".join(lines)


def format_terms(
    spec: ModelSpec, *, seq: int, precision: str = "bf16-mixed", recompute: str = "none"
) -> str:
    """What one layer saves per token, tensor by tensor, in bytes and in units of h, beside the
    playbook's 34 + 5·a·s/h (16-bit) for the same dimensions."""
    terms = layer_terms(
        spec, seq=seq, dtype_bytes=PRECISIONS[precision]["param"], recompute=recompute
    )
    h = spec.hidden
    lines = [f"{'saved tensor':<24}{'bytes/token':>14}{'/ h':>9}  split"]
    lines += [f"{t.name:<24}{t.bytes:>14,.0f}{t.bytes / h:>9.2f}  {t.split}" for t in terms]
    total = sum(t.bytes for t in terms)
    playbook = 34 + 5 * spec.n_heads * seq / h
    lines += [
        f"{'total per layer':<24}{total:>14,.0f}{total / h:>9.2f}",
        f"{'playbook 34 + 5as/h':<24}{playbook * h:>14,.0f}{playbook:>9.2f}"
        "  (16-bit, eager attention)",
    ]
    return "\n".join(lines)


def playbook_comparison(
    seq: int = 4096, *, precision: str = "bf16-mixed", names: Iterable[str] | None = None
) -> list[dict]:
    """Per preset, bytes one layer keeps per token with no recomputation: ours
    (``labs.theory.activations``, the course's model: flash attention, fp32 norms) beside the
    playbook's formula s·b·h·(34 + 5·a·s/h) (GPT, eager attention, 16-bit), each also in units
    of h, and ``ratio`` = playbook / ours. For gpt2-small ours *is* the playbook's formula."""
    e = PRECISIONS[precision]["param"]
    rows = []
    for name in names or PRESETS:
        spec = get_preset(name)
        ours = terms_bytes(layer_terms(spec, seq=seq, dtype_bytes=e), seq=1, mbs=1)
        playbook = playbook_layer_bytes(seq=seq, mbs=1, hidden=spec.hidden, heads=spec.n_heads)
        playbook /= seq  # per token
        rows.append(
            {
                "model": name,
                "seq": seq,
                "ours_bytes_per_token": ours,
                "playbook_bytes_per_token": playbook,
                "ours_per_h": ours / spec.hidden,
                "playbook_per_h": playbook / spec.hidden,
                "ratio": playbook / ours,
            }
        )
    return rows


def format_playbook_comparison(rows: list[dict]) -> str:
    """``playbook_comparison``'s rows as a table, each column labelled with its source."""
    lines = [
        f"bytes one layer keeps per token, no recomputation, seq {rows[0]['seq']}",
        f"{'':<14}{'ours (calculator)':>21}{'playbook 34 + 5as/h':>28}{'playbook':>12}",
        f"{'model':<14}{'bytes':>12}{'/ h':>9}{'bytes':>19}{'/ h':>9}{'/ ours':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r['model']:<14}{r['ours_bytes_per_token']:>12,.0f}{r['ours_per_h']:>9.2f}"
            f"{r['playbook_bytes_per_token']:>19,.0f}{r['playbook_per_h']:>9.2f}"
            f"{r['ratio']:>11.2f}x"
        )
    return "\n".join(lines)


def report(
    spec: ModelSpec,
    *,
    model: str = "custom",
    gpu_mem: str | float | None = None,
    step_time: float | None = None,
    peak_tflops: float | None = None,
    **run: object,
) -> dict:
    """What ``python -m labs.theory memory`` prints: ``memory_per_rank`` (``run`` holds its
    keywords) with the model's name and parameters, the configuration, FLOPs per token, with
    ``gpu_mem`` (GiB, or a number with a unit: ``gpu_memory_gib``) the verdict, and with a measured
    ``step_time`` (s) and ``peak_tflops`` the MFU."""
    unknown = sorted(set(run) - set(RUN_KEYS))
    if unknown:
        raise ValueError(f"unknown keyword(s) {unknown}; choose from {RUN_KEYS}")
    config = {key: run[key] for key in RUN_KEYS if key in run}
    result = memory_per_rank(spec, **config)
    config["microbatches"] = config.get("microbatches") or config.get("pp", 1)
    out = {"model": model, "total_params": param_count(spec), **result, "config": config}
    if gpu_mem is not None:
        gib = gpu_memory_gib(gpu_mem)
        out.update(
            gpu_mem_gib=gib,
            fits=fits(result["total_bytes"], gib),
            verdict=verdict(result["total_bytes"], gib),
        )
    out["flops_per_token"] = flops_per_token(spec, seq=config["seq"])
    if step_time is not None and peak_tflops is not None:
        degrees = {axis: config.get(axis, 1) for axis in ("dp", "tp", "pp", "cp")}
        tokens = config["seq"] * config["mbs"] * config["microbatches"] * degrees["dp"]
        out["mfu"] = mfu(
            out["flops_per_token"] * tokens,
            step_time_s=step_time,
            peak_flops=peak_tflops * 1e12,
            n_gpus=degrees["dp"] * degrees["tp"] * degrees["pp"] * degrees["cp"],
        )
    return out


def format_result(r: dict) -> str:
    """``report``'s result as text: the model, the run, the stage and GiB per rank by part."""
    c = r["config"]
    parallel = " ".join(f"{d}={c[d]}" for d in ("dp", "tp", "pp", "cp"))
    if c["sp"]:
        parallel += " +sp"
    if c.get("ep", 1) > 1:
        parallel += f" ep={c['ep']}"
    schedule = ""
    if c["pp"] > 1:
        v = f", V={c['virtual']}" if c["schedule"] == "interleaved" else ""
        schedule = f", {c['schedule']}{v}, {c['microbatches']} micro-batches"
    extras = [x for x, on in (("fp8", c.get("fp8")), ("offload", c.get("offload"))) if on]
    lines = [
        f"model       {r['model']}: {r['total_params']:,} parameters, {r['params']:,} on this rank",
        f"run         seq {c['seq']}, mbs {c['mbs']}, {c['precision']}, {c['optimizer']},"
        f" ZeRO-{c['zero']}, {parallel}, recompute {c['recompute']}{schedule}"
        + "".join(f", {x}" for x in extras),
        f"rank        pipeline stage {r['stage']}: {r['layers']} layers,"
        f" {r['in_flight']} micro-batch(es) in flight",
        "",
        f"{'per rank':<22}{'GiB':>10}",
    ]
    for key, label in (
        ("param_bytes", "parameters"),
        ("grad_bytes", "gradients"),
        ("optimizer_bytes", "optimizer state"),
        ("activation_bytes", "activations"),
        ("total_bytes", "total"),
    ):
        lines.append(f"{label:<22}{r[key] / GIB:>10.2f}")
    if r.get("offloaded_bytes"):
        lines.append(f"{'in host memory':<22}{r['offloaded_bytes'] / GIB:>10.2f}")
    if "verdict" in r:
        lines += ["", r["verdict"]]
    if "mfu" in r:
        lines.append(f"MFU {r['mfu']:.1%}")
    return "\n".join(lines)

"""Notebooks 05 and 09: what ``device_map="auto"``, ``"balanced"`` and ``"sequential"`` do with the
course model, computed by accelerate's own placement functions, beside the lab's placement.

    rows = device_maps(layers=8, devices=4, budget=0.5)   # each device may hold half the model
    print(format_device_maps(rows))

What the strings mean, read from the pinned libraries' source (accelerate 1.x,
``accelerate.utils.modeling``; transformers 5.x, ``transformers.integrations.accelerate.
_get_device_map``, which ``from_pretrained(device_map=...)`` calls; accelerate's
``load_checkpoint_and_dispatch`` does the same):

* ``infer_auto_device_map(model, max_memory)`` walks the modules in order and fills device 0 up to
  its budget, then device 1, and so on, never splitting a module named in
  ``no_split_module_classes`` (a transformer block: its residual adds want all of it on one
  device). Device 0 (a "main device", like the CPU) keeps room for the largest layer, in case
  one offloaded to the CPU or disk must come back. ``"sequential"`` is that alone, with the
  budgets as given.
* ``"auto"`` and ``"balanced"`` are the same strategy in both libraries: before filling, every
  budget but the last device's is lowered by ``get_balanced_memory`` to the model's bytes / number
  of devices plus a buffer, 1.25 × the larger of the biggest no-split block and the mean leaf
  module. Filling in order then spreads the model over the devices instead of packing device 0.
  The buffer rounds up, so the first devices take a layer more and the last may get none.
* ``"balanced_low_0"`` lowers device 0's budget as far as the others allow (room for what
  ``generate`` puts there).

Everything runs on a meta-device model (``accelerate.init_empty_weights``): no GPU, no weights, no
download; the sizes come from the parameters' shapes and dtype. ``max_memory``'s integer keys name
GPUs this machine may not have: accelerate warns that they are not available (silenced here), and
places by the budgets all the same.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from labs.experiments.pp import layer_costs, make_plan
from labs.models.transformer import ModelConfig, Transformer
from labs.theory import pipeline as theory

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
NO_SPLIT = ["Block"]  # the course model's transformer block (transformers: _no_split_modules)


def meta_model(cfg: ModelConfig) -> Transformer:
    """The course model with every parameter on the meta device: shapes and dtypes, no memory."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return Transformer(cfg)


@contextmanager
def _quiet_accelerate():
    """accelerate warns once per integer key that no such GPU exists here; the budgets are what
    matter."""
    log = logging.getLogger("accelerate.utils.modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def accelerate_device_map(
    model: torch.nn.Module,
    strategy: str,
    max_memory: dict,
    no_split_module_classes: list[str] = NO_SPLIT,
) -> tuple[dict, dict]:
    """``(device_map, the max_memory it was filled with)`` for ``device_map=strategy``, computed
    as ``transformers``' ``_get_device_map`` does: ``get_balanced_memory`` first (low_zero for
    "balanced_low_0") unless "sequential", then ``infer_auto_device_map``."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    with _quiet_accelerate():
        if strategy == "sequential":
            budgets = dict(max_memory)
        else:
            budgets = get_balanced_memory(
                model,
                max_memory=dict(max_memory),
                no_split_module_classes=no_split_module_classes,
                low_zero=strategy == "balanced_low_0",
            )
        device_map = infer_auto_device_map(
            model, max_memory=dict(budgets), no_split_module_classes=no_split_module_classes
        )
    return dict(device_map), budgets


def _device_of(device_map: dict, name: str):
    """The device of module ``name``: its own entry or its closest ancestor's ('' is the root)."""
    parts = name.split(".")
    for n in range(len(parts), -1, -1):
        key = ".".join(parts[:n])
        if key in device_map:
            return device_map[key]
    raise KeyError(f"{name} is not placed by {device_map}")


def placed(device_map: dict, model: torch.nn.Module, devices: int) -> dict:
    """Layers and bytes per device (0..devices-1, then any "cpu" or "disk" overflow) of a device
    map of the course model, and where the embedding and the head went."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    names = ["tok_emb", *(f"layers.{i}" for i in range(len(model.layers))), "norm", "lm_head"]
    where = {name: _device_of(device_map, name) for name in names}
    targets = [*range(devices), *sorted({d for d in where.values() if not isinstance(d, int)})]
    return {
        "layers": [
            sum(where[f"layers.{i}"] == d for i in range(len(model.layers))) for d in targets
        ],
        "bytes": [sum(sizes[n] for n in names if where[n] == d) for d in targets],
        "devices": targets,
        "embedding": where["tok_emb"],
        "head": where["lm_head"],
    }


def device_maps(
    *,
    layers: int = 8,
    devices: int = 4,
    budget: float = 0.5,
    strategies: tuple[str, ...] = STRATEGIES,
) -> list[dict]:
    """The course model with ``layers`` blocks (fp32) on ``devices`` devices that may each hold
    ``budget`` of its bytes: one row per accelerate strategy (layers and bytes per device, the
    budgets it filled), then the lab's two placements (notebook 05): its pipeline stages,
    balanced by parameters, and its naive fill up to the balanced split's largest stage."""
    if not budget > 0:
        raise ValueError(f"budget={budget!r} must be > 0 (a fraction of the model per device)")
    cfg = ModelConfig(n_layer=layers)
    model = meta_model(cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    max_memory = {d: int(budget * total) for d in range(devices)}
    rows = []
    for strategy in strategies:
        device_map, budgets = accelerate_device_map(model, strategy, max_memory)
        rows.append(
            {
                "placement": f'accelerate device_map="{strategy}"',
                "strategy": strategy,
                "max_memory": {d: int(b) for d, b in budgets.items()},
                "device_map": device_map,
                **placed(device_map, model, devices),
            }
        )
    costs, first, last = layer_costs(cfg)
    itemsize = next(model.parameters()).element_size()
    for name, plan in (
        ("the lab's stages (balanced by parameters)", make_plan("1f1b", cfg, devices, 1)),
        ("the lab's naive fill", make_plan("naive", cfg, devices, 1)),
    ):
        rows.append(
            {
                "placement": name,
                "layers": list(plan),
                "bytes": [itemsize * c for c in theory.plan_costs(costs, plan, first, last)],
                "devices": list(range(devices)),
                "embedding": 0,
                "head": devices - 1,
            }
        )
    return rows


def format_device_maps(rows: list[dict]) -> str:
    """One line per placement: layers per device, then kB per device (overflow devices named)."""
    width = max(len(r["placement"]) for r in rows)
    lines = [f"{'placement':<{width}}  layers per device      kB per device"]
    for r in rows:
        names = [str(d) for d in r["devices"]]
        layers = " ".join(f"{d}:{n}" for d, n in zip(names, r["layers"]))
        kb = " ".join(f"{b / 1e3:.0f}" for b in r["bytes"])
        lines.append(f"{r['placement']:<{width}}  {layers:<22} {kb}")
    return "\n".join(lines)

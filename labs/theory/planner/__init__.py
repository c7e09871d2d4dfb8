"""The parallelism planner (notebook 08): which DP x TP x PP x CP layout to train a model with.
Pure Python.

    plan(preset("llama3-70b"), seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
    # -> the fastest layout that fits, the top five, and what the playbook's rule picks
    rule_plan(preset("llama3-70b"), seq=32768, gpus=512, gpus_per_node=8, gpu_mem_gib=80)
    # -> dp 4, tp 8, pp 4, cp 4: the rule alone
    evaluate_layout(preset("llama3-405b"), "tp=8,pp=16,cp=1,dp=128,zero=1", seq=8192,
                    gpus=16384, gpus_per_node=8, gpu_mem_gib=79.6, global_batch=2048)
    scaling(preset("llama3-70b"), [128, 512, 2048], seq=32768, gpus_per_node=8, gpu_mem_gib=80)
    python -m labs.theory plan --preset llama3-70b --seq 32768 --gpus 512 --gpus-per-node 8 \\
        --gpu-mem 80 --json

One module per part, read in this order:

    cost.py        one layout's memory, bytes per axis, exposed communication and step time
                   (``evaluate``), from the course's calculators; the inputs checked up front
    rule.py        the Ultra-Scale Playbook's rule of thumb, made mechanical (``rule_plan``)
    search.py      every layout that fits, the fastest first (``plan``); a layout you give
                   (``evaluate_layout``); the plan across cluster sizes (``scaling``)
    report.py      the plan as plain JSON and as text (the CLI and the widget print these)
    published.py   published training runs against the cost model
    multimodal.py  the planner with an encoder in front of the decoder (notebook 11)

The command line is ``labs.theory.cli`` (``python -m labs.theory plan``).
"""

from labs.theory.planner.cost import (
    ASSUMPTIONS,
    MBS_CHOICES,
    TOKENS_PER_BATCH,
    VIRTUAL_CHOICES,
    Cluster,
    comm_per_step,
    describe,
    evaluate,
)
from labs.theory.planner.rule import rule_plan
from labs.theory.planner.search import (
    LAYOUT_KEYS,
    SCALING_KEYS,
    TOP,
    candidates,
    evaluate_layout,
    explain,
    parse_layout,
    plan,
    scaling,
)

__all__ = [
    "ASSUMPTIONS",
    "LAYOUT_KEYS",
    "MBS_CHOICES",
    "SCALING_KEYS",
    "TOKENS_PER_BATCH",
    "TOP",
    "VIRTUAL_CHOICES",
    "Cluster",
    "candidates",
    "comm_per_step",
    "describe",
    "evaluate",
    "evaluate_layout",
    "explain",
    "parse_layout",
    "plan",
    "rule_plan",
    "scaling",
]

"""What every experiment shares: the summary every lab reports and a readable printout.

An *experiment* (``labs.experiments.<lab>``) runs one lab on N ranks and checks it
three ways: against the single-process reference, against the theory's figures and,
where one exists, against PyTorch's own implementation. Each module declares itself (``LAB``,
its ``Options``: ``labs.experiments.spec``) and exposes

    run(*, nproc=None, steps, backend="auto", vs_torch=False, timeout=..., **options) -> RunSummary

and ``run`` returns a :class:`RunSummary`: the ``labs.run --json`` contract's keys
(``SUMMARY_KEYS``) as fields, the lab's own figures in ``details``, and its checks, the verdict.
A summary reads like a dict (``summary["max_rel_grad_diff"]``, ``"worst_grad" in summary``,
``summary.get(...)``), and ``to_json`` writes it flat, the contract's keys first, as the README
documents. What it says about the run's correctness it reads off its checks, by name
(``summary.check("losses").ok``); ``matches_reference`` is derived from them by one rule
(``labs.experiments.checks.matches``).

Metric names follow the contract's pattern, ``max_<abs|rel>_<what>_diff`` (``max_rel_grad_diff``,
``max_rel_param_diff``, ...).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

from labs.experiments.checks import Check, find, matches, passed, verdict_table
from labs.theory.memory import ModelSpec

# A summary's figure: one number, one per rank, or (``infer --mode both``) one per mode.
Figure = float | list | dict | None


@dataclasses.dataclass(eq=False)
class RunSummary(MutableMapping):
    """One lab run: the command-line contract's keys, then the lab's own figures in ``details``.

    Bytes are per rank and per step; times are seconds per step by the course's rule
    (``labs.measure.timing``: the median after the warm-up step, the slowest rank's).
    """

    lab: str
    nproc: int
    backend: str  # what the ranks' process group ran ("gloo" or "nccl"), reported by the ranks
    impl: str  # whose exercise code ran: "solutions" or "labs"
    steps: int
    loss: float | None = None  # the last step's loss
    reference_loss: float | None = None  # the single-process reference's, same step
    max_abs_loss_diff: float | None = None  # over every step
    comm_bytes_per_rank: Figure = None
    theory_comm_bytes_per_rank: Figure = None
    state_bytes_per_rank: Figure = None
    theory_state_bytes_per_rank: Figure = None
    step_time_s: Figure = None
    torch_step_time_s: Figure = None  # PyTorch's own implementation (``vs_torch``), or None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)  # the lab's own figures
    checks: list[Check] = dataclasses.field(default_factory=list)  # what decides the verdict

    @property
    def passed(self) -> bool:
        """The verdict: at least one check, and every check passed."""
        return passed(self.checks)

    @property
    def matches_reference(self) -> bool | None:
        """Every check against the single-process reference passed (None: the run made none)."""
        return matches(self.checks, "reference")

    def check(self, name: str) -> Check:
        """The check named ``name`` (e.g. ``summary.check("bucketed: losses").ok``)."""
        return find(self.checks, name)

    def add_checks(self, checks: Iterable[Check]) -> None:
        self.checks.extend(checks)

    def verdict(self) -> str:
        """The verdict table: a line per check, then PASS, or FAIL with what failed and a hint."""
        return verdict_table(self.checks, lab=self.lab)

    # Mapping access: a contract key reads and writes its field, a key derived from the checks
    # reads its property, any other key the details.
    def __getitem__(self, key: str) -> Any:
        if key in _FIELDS or key in DERIVED_KEYS:
            return getattr(self, key)
        return self.details[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in DERIVED_KEYS:
            raise TypeError(f"{key!r} is derived from the checks: add a check instead")
        if key in _FIELDS:
            setattr(self, key, value)
        else:
            self.details[key] = value

    def __delitem__(self, key: str) -> None:
        if key in _FIELDS or key in DERIVED_KEYS:
            raise TypeError(f"{key!r} is a contract key: set it to None rather than delete it")
        del self.details[key]

    def __iter__(self) -> Iterator[str]:
        yield from SUMMARY_KEYS
        yield from self.details
        yield from DERIVED_KEYS

    def __len__(self) -> int:
        return len(SUMMARY_KEYS) + len(self.details) + len(DERIVED_KEYS)

    def to_dict(self) -> dict[str, Any]:
        """The flat dict ``--json`` writes: contract keys, the details' keys, the keys derived
        from the checks, then ``passed`` and ``checks`` (name, ok, measured, expected, tolerance,
        where, hint, against)."""
        out = dict(self)
        out["passed"] = self.passed
        out["checks"] = [c.to_dict() for c in self.checks]
        return out


SUMMARY_KEYS = tuple(
    f.name for f in dataclasses.fields(RunSummary) if f.name not in ("details", "checks")
)
_FIELDS = frozenset(SUMMARY_KEYS)
# Keys a summary reads off its checks (properties of RunSummary), written to the JSON too.
DERIVED_KEYS = ("matches_reference",)


def course_spec(cfg) -> ModelSpec:
    """The theory's description of the course model ``cfg`` (a
    ``labs.models.transformer.ModelConfig``)."""
    return ModelSpec(
        vocab_size=cfg.vocab_size,
        hidden=cfg.n_embd,
        n_layers=cfg.n_layer,
        n_heads=cfg.n_head,
        n_kv_heads=cfg.n_kv_head,
        ffn_hidden=cfg.ffn_hidden,
        tied_embeddings=cfg.tie_embeddings,
    )


def new_summary(lab: str, *, nproc: int, backend: str, steps: int, **details) -> RunSummary:
    """A summary of ``lab`` (contract figures None until the experiment fills them in).
    ``backend``: the one the ranks reported (``launch(...).backend``); ``details``: the lab's
    own figures, after ``reference_exercises`` (the exercises whose reference stood in for the
    learner's, ``LABS_REFERENCE``) when there are any."""
    from labs.runtime.impl import implementation, reference_exercises

    stand_ins = list(reference_exercises())  # LABS_REFERENCE: said only when set
    return RunSummary(
        lab=lab,
        nproc=nproc,
        backend=backend,
        impl=implementation(),
        steps=steps,
        details={**({"reference_exercises": stand_ins} if stand_ins else {}), **details},
    )


def fill_losses(
    summary: MutableMapping, losses: list[float], reference: list[float]
) -> MutableMapping:
    """Record a run's losses beside the reference's: ``loss`` and ``reference_loss`` (last step),
    ``losses``, ``reference_losses``, ``max_abs_loss_diff`` and ``max_rel_loss_diff``. Whether
    they match is a check's to say (``labs.experiments.checks.losses_check``)."""
    from labs.train import compare_losses

    summary.update(
        loss=losses[-1],
        reference_loss=reference[-1],
        losses=list(losses),
        reference_losses=list(reference),
        **compare_losses(losses, reference),
    )
    return summary


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 8:
        return "[" + ", ".join(_fmt(v) for v in value[:8]) + ", ...]"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def format_summary(summary: RunSummary | Mapping[str, Any]) -> str:
    """Two aligned columns, the contract's keys first, then the lab's own in alphabetical order
    (a plain mapping, e.g. a summary with some keys left out, prints the same way)."""
    contract = [k for k in SUMMARY_KEYS if k in summary]
    own = sorted(k for k in summary if k not in _FIELDS)
    keys = contract + own
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {_fmt(summary[k])}" for k in keys)


def to_dict(summary: RunSummary | Mapping[str, Any]) -> dict[str, Any]:
    """The flat dict of a summary, as ``--json`` writes it (contract keys, the lab's, and for a
    :class:`RunSummary` its ``matches_reference``, ``passed`` and ``checks``)."""
    if isinstance(summary, RunSummary):
        return summary.to_dict()
    return dict(summary)


def to_json(summary: RunSummary | Mapping[str, Any]) -> str:
    """One JSON object: ``to_dict(summary)``."""
    return json.dumps(to_dict(summary), default=float)


COMM_HEADER = f"{'calls':>6}{'payload B':>11}{'sent B/rank':>13}   theory: calls, payload, sent"


def comm_row(measured: dict, theory: dict) -> str:
    """One op's measured ``calls``/``payload_bytes``/``sent_bytes`` beside the theory's, aligned
    under COMM_HEADER."""
    keys = ("calls", "payload_bytes", "sent_bytes")
    m = [measured.get(k, 0) for k in keys]
    t = [theory.get(k, 0) for k in keys]
    return f"{m[0]:>6.10g}{m[1]:>11.10g}{m[2]:>13.10g}   {t[0]:.10g}, {t[1]:.10g}, {t[2]:.10g}"

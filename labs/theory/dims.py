"""Parallel degrees, validated up front: the product of the degrees is the world size, and
every tensor dimension divides by the degree that splits it. Pure Python.

    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    dims.check_model(n_head=8, n_kv_head=4, n_embd=64, vocab_size=256, n_layer=2, seq_len=32)

Every error is a ``ValueError`` that names the numbers and says what to change, raised
before any process group or collective exists (a bad degree found inside a collective
is a hang or a stack trace from deep in torch).

Rank order (the mesh of notebook 08): ranks fill a (dp, pp, cp, tp) grid with tp
innermost, so the ranks of one TP group are consecutive and sit on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp", "pp", "cp", "tp")  # outermost to innermost


def divisors(n: int) -> list[int]:
    """Every d in 1..n that divides n."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(
    value: int,
    value_name: str,
    degree: int,
    degree_name: str,
    *,
    also_divide: tuple[int, str] | None = None,
) -> None:
    """Raise if ``degree`` does not divide ``value``, listing the degrees that would; with
    ``also_divide=(n, "name")`` only those that divide ``n`` too (the ones valid here)."""
    if value % degree:
        choices = divisors(value)
        where = ""
        if also_divide is not None:
            n, name = also_divide
            choices = [d for d in choices if n % d == 0]
            where = f" (those that also divide {name}={n})"
        raise ValueError(
            f"{value_name}={value} is not divisible by {degree_name}={degree}; use {degree_name}"
            f" in {{{','.join(map(str, choices))}}}{where} or change {value_name}"
        )


def check_positive(**values: object) -> None:
    """Raise unless every value is an integer >= 1 (a bool is not), naming the first that is
    not."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism: carved out of dp x cp, as torchtitan does
    world_size: int | None = None  # defaults to the product of dp, tp, pp, cp

    def __post_init__(self):
        check_positive(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)
        product = self.dp * self.tp * self.pp * self.cp
        if self.world_size is None:
            object.__setattr__(self, "world_size", product)
        check_positive(world_size=self.world_size)
        if product != self.world_size:
            raise ValueError(
                f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {product} but"
                f" world_size={self.world_size}; choose degrees whose product is"
                f" {self.world_size}"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp*cp={self.dp * self.cp}: experts are spread over "
                f"the data- and context-parallel ranks"
            )

    @property
    def degrees(self) -> dict[str, int]:
        """Axis name -> degree, outermost to innermost."""
        return {axis: getattr(self, axis) for axis in AXES}

    def coords(self, rank: int) -> dict[str, int]:
        """Position of ``rank`` in the (dp, pp, cp, tp) grid, tp innermost."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside 0..{self.world_size - 1}")
        out = {}
        for axis in reversed(AXES):
            out[axis] = rank % self.degrees[axis]
            rank //= self.degrees[axis]
        return {axis: out[axis] for axis in AXES}

    def groups(self, axis: str) -> list[list[int]]:
        """All rank groups along ``axis``: ranks that differ only in that coordinate."""
        if axis not in AXES:
            raise ValueError(f"axis={axis!r} is not one of {AXES}")
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(v for a, v in c.items() if a != axis)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def check_model(
        self,
        *,
        n_head: int | None = None,
        n_kv_head: int | None = None,
        n_embd: int | None = None,
        vocab_size: int | None = None,
        ffn_hidden: int | None = None,
        n_layer: int | None = None,
        seq_len: int | None = None,
        n_experts: int | None = None,
        virtual_stages: int = 1,
        cp_chunks_per_rank: int = 1,
    ) -> None:
        """Raise if a model dimension does not split evenly over the degree that splits it."""
        if self.tp > 1:
            split = {
                name: value
                for name, value in (
                    ("n_head", n_head),
                    ("n_kv_head", n_kv_head),
                    ("n_embd", n_embd),
                    ("vocab_size", vocab_size),
                    ("ffn_hidden", ffn_hidden),
                )
                if value is not None
            }
            for name, value in split.items():
                if value % self.tp:
                    # suggest only degrees that split every dimension tp splits
                    valid = [d for d in divisors(value) if all(v % d == 0 for v in split.values())]
                    others = ", ".join(f"{n}={v}" for n, v in split.items() if n != name)
                    raise ValueError(
                        f"{name}={value} is not divisible by tp={self.tp}; use tp in"
                        f" {{{','.join(map(str, valid))}}} (they also divide {others})"
                        f" or change {name}"
                    )
        if n_layer is not None:
            check_positive(n_layer=n_layer, virtual_stages=virtual_stages)
        if n_layer is not None and self.pp * virtual_stages > n_layer:
            raise ValueError(
                f"pp={self.pp} x virtual_stages={virtual_stages} ="
                f" {self.pp * virtual_stages} stages but only n_layer={n_layer} layers;"
                f" use pp*virtual_stages <= {n_layer}"
            )
        if seq_len is not None and self.cp > 1:
            check_divides(
                seq_len,
                "seq_len",
                self.cp * cp_chunks_per_rank,
                "cp" if cp_chunks_per_rank == 1 else f"cp*{cp_chunks_per_rank}",
            )
        if n_experts is not None and self.ep > 1:
            # ep must divide dp*cp too (__post_init__): suggest only degrees valid for both
            dp_cp = (self.dp * self.cp, "dp*cp")
            check_divides(n_experts, "n_experts", self.ep, "ep", also_divide=dp_cp)

"""Ring-attention stepper (notebook 06): step through the ring and see who computes what.

    ring_stepper(cp=4)                                    # sliders and toggles
    draw_ring_step(4, step=1, causal=True, zigzag=True)   # one drawing, as a matplotlib figure
    draw_ring_step(4, step=1, backward=True)              # the backward pass at that step

Left: the attention matrix cut into 2·CP × 2·CP chunk blocks (rows: query chunks, columns:
key chunks). A block is coloured by the rank that computes it, solid at the current step,
pale at earlier steps; a diagonal block shows only its lower triangle; a fully masked block
is grey and hatched once the ring has brought it past its rank (it is skipped, never
computed). Right: blocks computed per rank so far, with the whole ring's total dashed.

Backward (``backward=True``): the same blocks are computed again (the scores are recomputed),
each giving three gradients. dQ stays with the queries' rank; dK, dV belong to the owner of the
K/V block and travel in an accumulator one hop behind it. The right panel then shows, for every
K/V block, how many ranks' shares of its gradient are gathered so far (kept at home by its owner
at step 0, or in the accumulator on its way, and which rank holds it), until all CP are home.
The logic is ``labs.theory.context_parallel`` (``ring_schedule``, ``ring_backward_schedule``);
this module only draws.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Polygon, Rectangle

from labs.theory.context_parallel import (
    LAYOUTS,
    ring_backward_schedule,
    ring_schedule,
    work_per_rank,
)

RANK_COLOURS = plt.get_cmap("tab10")


def step_rows(
    cp: int, step: int, *, causal: bool = True, zigzag: bool = True, backward: bool = False
) -> list[dict]:
    """One row per rank at ``step``: its query chunks, whose K/V it holds, blocks computed and
    masked; with ``backward``, where its gradients go (``ring_backward_schedule``'s entries:
    ``dkv_block``, ``acc_ranks``, ``sends_dkv_to``, ``dkv_home``)."""
    schedule = (ring_backward_schedule if backward else ring_schedule)(
        cp, causal=causal, zigzag=zigzag
    )
    if not 0 <= step < cp:
        raise ValueError(
            f"step={step} is outside 0..{cp - 1} (a ring of cp={cp} ranks has {cp} steps)"
        )
    extra = ("dkv_block", "acc_ranks", "sends_dkv_to", "dkv_home") if backward else ()
    return [
        {
            "rank": e["rank"],
            "q_chunks": e["q_chunks"],
            "kv_from": e["kv_from"],
            "kv_chunks": e["kv_chunks"],
            "computed": sum(kind != "masked" for *_, kind in e["blocks"]),
            "masked": sum(kind == "masked" for *_, kind in e["blocks"]),
            **{key: e[key] for key in extra},
        }
        for e in schedule[step]
    ]


def gradient_progress(cp: int, step: int) -> list[dict]:
    """Per K/V block (its owner ``block``), after backward step ``step``: how many ranks' dK/dV
    shares are gathered (``home``: kept by the owner; ``travelling``: in the accumulator) and
    which rank holds that accumulator (None once it is home)."""
    schedule = ring_backward_schedule(cp)
    out = []
    for b in range(cp):
        acc = next((e for e in schedule[step] if e["dkv_block"] == b and step > 0), None)
        arrived = acc is not None and acc["dkv_home"]
        out.append(
            {
                "block": b,
                "home": 1 + (len(acc["acc_ranks"]) if arrived else 0),
                "travelling": 0 if acc is None or arrived else len(acc["acc_ranks"]),
                "at_rank": None if acc is None or arrived else acc["sends_dkv_to"],
            }
        )
    return out


def _draw_block(ax, a, b, kind, colour, current):
    # column = key chunk, row = query chunk (chunk 0 on top)
    x = b
    y = -a - 1
    if kind == "masked":
        ax.add_patch(
            Rectangle((x, y), 1, 1, facecolor="0.88", edgecolor="0.6", hatch="///", lw=0.5)
        )
        return
    alpha = 0.95 if current else 0.3
    if kind == "diagonal":  # keys up to the query: the lower-left triangle of the block
        ax.add_patch(Polygon([(x, y + 1), (x, y), (x + 1, y)], facecolor=colour, alpha=alpha, lw=0))
        ax.add_patch(Rectangle((x, y), 1, 1, fill=False, edgecolor="0.5", lw=0.5))
    else:
        ax.add_patch(
            Rectangle((x, y), 1, 1, facecolor=colour, alpha=alpha, edgecolor="0.5", lw=0.5)
        )
    if current:
        ax.add_patch(Rectangle((x, y), 1, 1, fill=False, edgecolor="black", lw=2))


def draw_ring_step(
    cp: int, step: int, *, causal: bool = True, zigzag: bool = True, backward: bool = False
):
    """The stepper's drawing at ``step`` (of the backward pass with ``backward``); returns
    (figure, ``step_rows`` of that step)."""
    schedule = ring_schedule(cp, causal=causal, zigzag=zigzag)
    rows = step_rows(cp, step, causal=causal, zigzag=zigzag, backward=backward)
    n = 2 * cp
    fig, (grid, bars) = plt.subplots(
        1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1.3, 1]}
    )
    # chunk -> the rank holding it
    owner = {c: e["rank"] for e in schedule[0] for c in e["q_chunks"]}
    for s in range(step + 1):
        for e in schedule[s]:
            for a, b, kind in e["blocks"]:
                _draw_block(grid, a, b, kind, RANK_COLOURS(e["rank"] % 10), current=s == step)
    grid.set_xlim(0, n)
    grid.set_ylim(-n, 0)
    grid.set_aspect("equal")
    grid.set_xticks(
        [b + 0.5 for b in range(n)], [f"{b}\nr{owner[b]}" for b in range(n)], fontsize=8
    )
    grid.set_yticks(
        [-a - 0.5 for a in range(n)], [f"q{a} r{owner[a]}" for a in range(n)], fontsize=8
    )
    grid.set_xlabel("key/value chunk (and the rank that owns it)")
    grid.set_title(
        f"{'backward ' if backward else ''}step {step}: rank r holds the K/V of rank"
        f" (r−{step}) mod {cp}",
        fontsize=10,
    )
    if backward:
        _draw_gradients(bars, cp, step)
        fig.tight_layout()
        return fig, rows

    now = work_per_rank(cp, causal=causal, zigzag=zigzag, upto_step=step)
    total = work_per_rank(cp, causal=causal, zigzag=zigzag)
    ranks = range(cp)
    colours = [RANK_COLOURS(r % 10) for r in ranks]
    bars.bar(ranks, [w["full"] for w in now], color=colours, label="full blocks")
    bars.bar(
        ranks,
        [w["diagonal"] for w in now],
        bottom=[w["full"] for w in now],
        color=colours,
        alpha=0.45,
        hatch="..",
        label="diagonal (half masked)",
    )
    bars.bar(
        ranks,
        [w["computed"] for w in total],
        fill=False,
        linestyle="--",
        edgecolor="black",
        label="whole ring",
    )
    bars.set_xticks(list(ranks), [f"rank {r}" for r in ranks], fontsize=8)
    bars.set_ylabel("attention blocks computed")
    bars.set_title(
        f"{LAYOUTS[zigzag]}, {'causal' if causal else 'no mask'}: work per rank", fontsize=10
    )
    bars.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    fig.tight_layout()
    return fig, rows


def _draw_gradients(ax, cp: int, step: int) -> None:
    """Per K/V block: the ranks' dK/dV shares kept at home and travelling in its accumulator."""
    progress = gradient_progress(cp, step)
    blocks = [p["block"] for p in progress]
    colours = [RANK_COLOURS(b % 10) for b in blocks]
    home = [p["home"] for p in progress]
    ax.bar(blocks, home, color=colours, label="at home (the owner's)")
    ax.bar(
        blocks,
        [p["travelling"] for p in progress],
        bottom=home,
        color=colours,
        alpha=0.4,
        hatch="//",
        label="in the accumulator, travelling",
    )
    for p in progress:
        where = "home" if p["at_rank"] is None else f"at r{p['at_rank']}"
        ax.text(p["block"], p["home"] + p["travelling"] + 0.05, where, ha="center", fontsize=8)
    ax.axhline(cp, color="black", ls="--", lw=1, label="all ranks' shares")
    ax.set_ylim(0, cp + 0.8)
    ax.set_xticks(blocks, [f"K/V of r{b}" for b in blocks], fontsize=8)
    ax.set_ylabel("ranks' dK, dV shares gathered")
    ax.set_title("dK, dV follow their block home; dQ stays local", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)


def _rows_html(rows: list[dict]) -> str:
    if "dkv_block" in rows[0]:
        head = (
            "<tr><th>rank</th><th>dQ of its queries (local)</th><th>holds K/V of</th>"
            "<th>computes</th><th>adds dK, dV to the gradient of</th><th>sends it on</th></tr>"
        )
        body = "".join(
            f"<tr><td>{r['rank']}</td><td>{r['q_chunks']}</td>"
            f"<td>rank {r['kv_from']} {r['kv_chunks']}</td><td>{r['computed']}</td>"
            f"<td>rank {r['dkv_block']}'s block</td><td>"
            + (
                "keeps it (its own block)"
                if r["sends_dkv_to"] is None
                else f"to rank {r['sends_dkv_to']}"
                + (" (home)" if r["dkv_home"] else "")
                + f", with the shares of ranks {r['acc_ranks']}"
            )
            + "</td></tr>"
            for r in rows
        )
        return f"<table>{head}{body}</table>"
    head = (
        "<tr><th>rank</th><th>query chunks</th><th>holds K/V of</th><th>computes</th>"
        "<th>skips (masked)</th></tr>"
    )
    body = "".join(
        f"<tr><td>{r['rank']}</td><td>{r['q_chunks']}</td>"
        f"<td>rank {r['kv_from']} {r['kv_chunks']}</td>"
        f"<td>{r['computed']}</td><td>{r['masked']}</td></tr>"
        for r in rows
    )
    return f"<table>{head}{body}</table>"


def ring_stepper(cp: int = 4, causal: bool = True, zigzag: bool = True):
    """The interactive widget: CP degree, mask, load balancing, and the ring step to show."""
    import ipywidgets as w
    from IPython.display import display

    cp_box = w.IntSlider(value=cp, min=1, max=8, description="CP degree")
    causal_box = w.Checkbox(value=causal, description="causal mask")
    zigzag_box = w.Checkbox(value=zigzag, description="zig-zag balance")
    backward_box = w.Checkbox(value=False, description="backward pass")
    step_box = w.IntSlider(value=0, min=0, max=cp - 1, description="ring step")
    play = w.Play(value=0, min=0, max=cp - 1, interval=1200)
    w.jslink((play, "value"), (step_box, "value"))
    table = w.HTML()
    out = w.Output()

    def redraw(*_):
        step_box.max = cp_box.value - 1
        play.max = cp_box.value - 1
        with out:
            out.clear_output(wait=True)
            fig, rows = draw_ring_step(
                cp_box.value,
                min(step_box.value, cp_box.value - 1),
                causal=causal_box.value,
                zigzag=zigzag_box.value,
                backward=backward_box.value,
            )
            display(fig)
            plt.close(fig)
        table.value = _rows_html(rows)

    for box in (cp_box, causal_box, zigzag_box, backward_box, step_box):
        box.observe(redraw, "value")
    redraw()
    ui = w.VBox(
        [
            w.HBox([cp_box, causal_box, zigzag_box, backward_box]),
            w.HBox([play, step_box]),
            out,
            table,
        ]
    )
    display(ui)
    return ui


def plot_work(checks: list[dict], ax=None):
    """Blocks computed per rank under a causal mask, measured (FLOPs / block FLOPs) as bars and the
    stepper's count as markers, zig-zag beside contiguous. ``checks``: ``attention_check``'s
    rows."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.2))
    causal = [c for c in checks if c["causal"]]
    width = 0.8 / len(causal)
    for i, c in enumerate(causal):
        ranks = [r + (i - (len(causal) - 1) / 2) * width for r in range(c["cp"])]
        ax.bar(
            ranks, c["blocks_measured_forward"], width, label=f"{c['layout']} (measured)", alpha=0.8
        )
        ax.plot(ranks, c["blocks_theory"], "k_", markersize=14, mew=2)
    ax.plot([], [], "k_", markersize=14, mew=2, label="stepper (theory)")
    ax.set_xticks(range(causal[0]["cp"]), [f"rank {r}" for r in range(causal[0]["cp"])])
    ax.set_ylabel("attention blocks computed")
    ax.set_title(f"causal ring attention on {causal[0]['cp']} ranks: work per rank", fontsize=10)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def plot_memory(rows: list[dict], ax=None):
    """Bytes saved for backward per rank against the CP degree (``memory_scaling``'s rows), with
    1/CP."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    cps = [r["cp"] for r in rows]
    for key, label in (
        ("model_saved", "whole model (measured)"),
        ("attention_saved", "one attention call"),
    ):
        ax.plot(cps, [r[key] / 1e3 for r in rows], "o-", label=label)
        ax.plot(cps, [rows[0][key] * rows[0]["cp"] / cp / 1e3 for cp in cps], "k:", lw=1)
    ax.plot(
        cps,
        [r["calculator"] / 1e3 for r in rows],
        "x",
        color="red",
        ms=9,
        label="memory calculator",
    )
    ax.plot([], [], "k:", lw=1, label="∝ 1/CP")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel("CP degree")
    ax.set_ylabel("saved for backward per rank (KB)")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def plot_long_context(rows: list[dict], gpu_gib: float = 79.6, ax=None):
    """Activation GiB per rank (``labs.theory.context_parallel.long_context_table``'s rows)
    against sequence length, one line per CP degree, and a GPU's memory in GiB (79.6: an H100
    "80 GB")."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.5))
    seq = [r["seq_len"] for r in rows]
    for key in [k for k in rows[0] if k.startswith("cp=")]:
        ax.loglog(seq, [r[key] for r in rows], "o-", label=key)
    ax.axhline(gpu_gib, color="red", ls="--", label=f"{gpu_gib:g} GiB GPU")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("activations per rank (GiB)")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.figure.tight_layout()
    return ax

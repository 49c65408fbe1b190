"""Figures of a plan and of its simulated epoch (matplotlib, Agg canvas, no display needed).

``timeline_figure``: per-rank timelines of a few consecutive micro-steps, one panel per simulation
(e.g. naive ISF beside HBP) on a shared time axis. Every rank's bar is its SP group's dense compute,
attention, Ulysses all-to-all and context-parallel all-gather seconds, then grey idle time until the
slowest group of the micro-step finishes. It shows where the epoch's time goes: naive single-level packing puts a 100K
sample beside packs of short chats in the same micro-step, so most ranks wait and every token pays
SP communication; HBP's levels and attention-balance sort leave almost no grey. Gradient
synchronization (once per optimizer step) is not drawn; it is in the titles' epoch totals. Every
time in it comes from the analytic cost model, never from a clock, so its titles and axis say
"simulated" and name the modelled GPUs: a CPU run's figure must not read as measured on its devices.

``length_histogram_figure``: the data's sample lengths coloured by the level each sample was packed
into, as sample counts and as tokens, with each level's pack length, SP degree, checkpointed layers,
samples and fill in the legend. It shows whether the levels fit the data: which samples each level
holds (GreedyFill moves short samples into the free space of larger packs), how many of the epoch's
tokens each level trains, and what was not packed.

Figures are plain ``matplotlib.figure.Figure`` objects on an Agg canvas, never registered with
pyplot, so a training run that logs them every epoch keeps no global figure state.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FuncFormatter, NullFormatter

from lit_hbp.packing.metrics import group_index

if TYPE_CHECKING:
    from lit_hbp.packing import Plan
    from lit_hbp.simulate.simulator import Simulation

TIMELINE_PARTS = ("dense", "attention", "vision", "ulysses_comm", "cp_comm", "offload", "idle")
PART_COLORS = {
    "dense": "#3A6FB0",
    "attention": "#F0B23A",
    "vision": "#2CA02C",
    "ulysses_comm": "#D62728",
    "cp_comm": "#FF9896",
    "offload": "#17BECF",
    "idle": "#D3D3D3",
}
PART_LABELS = {
    "dense": "dense compute (matmuls, recompute)",
    "attention": "attention",
    "vision": "vision tower (image and video encoding)",
    "ulysses_comm": "SP communication (Ulysses all-to-all)",
    "cp_comm": "CP all-gather/reduce-scatter",
    "offload": "activation offload (host copies not hidden)",
    "idle": "idle (waiting for the slowest SP group)",
}
# Levels get colours that the timeline's parts do not use (tab10 green, purple, brown, pink, ...).
LEVEL_COLORS = ("#2CA02C", "#9467BD", "#8C564B", "#E377C2", "#BCBD22", "#17BECF", "#1F77B4", "#FF7F0E")
UNPACKED_COLOR = "#7F7F7F"
DPI = 110


def _fmt_tokens(n: float) -> str:
    """16384 -> '16K', 131072 -> '128K', 1048576 -> '1M'; other counts as they are."""
    n = int(n)
    for div, unit in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _fmt_fill(fill: float) -> str:
    """Fill as a percentage rounded down, so 99.996% reads 99.99% and not a perfect 100.00%."""
    return f"{math.floor(fill * 1e4) / 100:.2f}%"


def _fmt_count(n: float) -> str:
    """3140000 -> '3.14M', 85300 -> '85.3k' (decimal units, unlike the binary K of pack lengths)."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit to show a duration in (tiny test models run micro-steps in microseconds) and the
    factor that converts seconds to it."""
    for unit, scale in (("h", 1 / 3600), ("min", 1 / 60), ("s", 1.0), ("ms", 1e3)):
        if seconds * scale >= 1 or unit == "ms" and seconds * scale >= 0.1:
            return unit, scale
    return "µs", 1e6


def _fmt_seconds(seconds: float) -> str:
    """Epochs in hours from 0.1 h (so plans compare in one unit), shorter spans in their own unit."""
    if seconds >= 360:
        return f"{seconds / 3600:.2f} h"
    unit, scale = _time_unit(seconds)
    return f"{seconds * scale:.3g} {unit}"


def _fmt_gpu_time(gpu_hours: float) -> str:
    """GPU-hours, or GPU-seconds (ms, µs) where an hour would round to nothing."""
    if gpu_hours >= 0.1:
        return f"{gpu_hours:,.1f} GPU-h"
    seconds = gpu_hours * 3600
    unit, scale = ("s", 1.0) if seconds >= 1 else _time_unit(seconds)
    return f"{seconds * scale:.3g} GPU-{unit}"


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _legend_below(fig: Figure, handles: list, fontsize: float, max_cols: int):
    """The figure's legend under its panels, in as many columns (at most ``max_cols``) as fit the
    figure's width: a wider one is cut off on both sides (constrained layout makes room below, not
    beside). The legend's width depends on its texts alone, measured without drawing the figure."""
    renderer = fig.canvas.get_renderer()
    for ncols in range(max(min(max_cols, len(handles)), 1), 0, -1):
        legend = fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=fontsize, frameon=False)
        if ncols == 1 or legend.get_window_extent(renderer).width <= 0.98 * fig.bbox.width:
            return legend
        legend.remove()
    return legend


# --------------------------------------------------------------------------------------------
# Timeline
# --------------------------------------------------------------------------------------------


def _micro_level(plan: Plan) -> np.ndarray:
    return np.repeat(plan.step_level, plan.accumulate)


def _idle_share(sim: Simulation) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-step: idle GPU-seconds and GPU-seconds (every rank for the micro-step's length)."""
    n = sim.micro_seconds.size
    idle = np.bincount(sim.group_micro, weights=sim.idle() * sim.group_sp, minlength=n)
    return idle, sim.micro_seconds * sim.plan.world_size


def _micro_tokens(sim: Simulation) -> np.ndarray:
    """Tokens trained at each micro-step."""
    g = group_index(sim.plan)
    micro = g["micro_of_group"][g["group_of_pack"]]
    return np.bincount(micro, weights=sim.plan.pack_tokens, minlength=sim.micro_seconds.size)


def default_start(sim: Simulation, n_micro: int = 6) -> int:
    """A representative window: it starts at a micro-step of the plan's largest level (where the
    long-context imbalance shows), and of those starts, the one whose idle share and seconds per
    token are closest to the whole epoch's."""
    n = sim.micro_seconds.size
    k = max(min(n_micro, n), 1)
    top = _micro_level(sim.plan) == len(sim.plan.levels) - 1
    cands = np.unique(np.minimum(np.flatnonzero(top) if top.any() else np.arange(n), max(n - k, 0)))
    idle, busy = _idle_share(sim)
    sums = [np.r_[0.0, np.cumsum(a)] for a in (idle, busy, _micro_tokens(sim))]
    end = np.minimum(cands + k, n)
    ci, cb, ct = ((c[end] - c[cands]) for c in sums)
    idle_gap = np.abs(ci / np.maximum(cb, 1e-30) - sums[0][-1] / max(sums[1][-1], 1e-30))
    rate = sums[1][-1] / max(sums[2][-1], 1.0)
    rate_gap = np.abs(cb / np.maximum(ct, 1.0) / max(rate, 1e-30) - 1)
    return int(cands[np.argmin(idle_gap + rate_gap)])


def _rank_groups(sim: Simulation, m: int, level: int) -> np.ndarray:
    """Index (into the simulation's group arrays) of every rank's SP group at micro-step m: groups
    of a micro-step are consecutive, and group g holds ranks [g * sp, (g + 1) * sp)."""
    first = int(np.searchsorted(sim.group_micro, m, side="left"))
    sp = sim.plan.levels[level].sp
    return first + np.arange(sim.plan.world_size) // sp


def _draw_timeline(ax, sim: Simulation, start: int, k: int, scale: float) -> tuple[list[float], list[float], list[str]]:
    """Draw micro-steps [start, start + k) of ``sim`` on ``ax``, times multiplied by ``scale``.
    Returns, per micro-step, its middle, its length and the label of its level."""
    plan = sim.plan
    world = plan.world_size
    levels = _micro_level(plan)
    idle = sim.idle()
    ranks = np.arange(world)
    segments = {p: ([], [], []) for p in TIMELINE_PARTS}  # y, left, width
    t = 0.0
    mids, spans, labels = [], [], []
    for m in range(start, start + k):
        lv = int(levels[m])
        g = _rank_groups(sim, m, lv)
        left = np.full(world, t)
        for part in TIMELINE_PARTS:
            width = (idle[g] if part == "idle" else sim.parts[part][g]) * scale
            ys, lefts, widths = segments[part]
            ys.append(ranks)
            lefts.append(left.copy())
            widths.append(width)
            left = left + width
        length = float(sim.micro_seconds[m]) * scale
        mids.append(t + length / 2)
        spans.append(length)
        level = plan.levels[lv]
        u, cp = level.layout
        labels.append(f"{_fmt_tokens(level.pack_len)}\nsp {level.sp}" + (f"={u}x{cp}" if cp > 1 else ""))
        t += length
        ax.axvline(t, color="black", linewidth=0.8, zorder=3)
    for part in TIMELINE_PARTS:
        ys, lefts, widths = (np.concatenate(a) for a in segments[part])
        ax.barh(
            ys,
            widths,
            left=lefts,
            height=0.82,
            color=PART_COLORS[part],
            label=PART_LABELS[part],
            linewidth=0,
            zorder=2,
        )
    ax.set_ylim(world - 0.5, -0.5)
    ax.set_yticks(np.arange(0, world, max(1, world // 8)))
    return mids, spans, labels


def timeline_figure(sims: Sequence[Simulation], n_micro: int = 6, start: int | None = None) -> Figure:
    """Per-rank timelines of ``n_micro`` consecutive micro-steps, one panel per simulation, on a
    shared time axis. Without ``start``, each panel shows its simulation's ``default_start`` window."""
    if not sims:
        raise ValueError("timeline_figure needs at least one simulation")
    n = len(sims)
    ncols = n if n <= 3 else 2
    nrows = -(-n // ncols)
    windows = []
    for sim in sims:
        total = sim.micro_seconds.size
        k = max(min(n_micro, total), 1)
        s = default_start(sim, k) if start is None else min(max(int(start), 0), max(total - k, 0))
        windows.append((s, k))
    span = max(float(sim.micro_seconds[s : s + k].sum()) for sim, (s, k) in zip(sims, windows))
    unit, scale = _time_unit(span)

    fig = _new_figure(5.4 * ncols + 0.6, 4.3 * nrows + 1.2)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, sharex=True, squeeze=False)).ravel()
    for i, (ax, sim, (s, k)) in enumerate(zip(axes, sims, windows)):
        mids, spans, labels = _draw_timeline(ax, sim, s, k, scale)
        # Label the level of each micro-step wide enough to hold its label on the shared scale.
        keep = [j for j, w in enumerate(spans) if w >= span * scale * 0.045]
        top = ax.secondary_xaxis("top")
        top.set_xticks([mids[j] for j in keep], [labels[j] for j in keep], fontsize=7)
        top.tick_params(length=0, pad=2)
        tokens = _micro_tokens(sim)[s : s + k].sum()
        idle, busy = _idle_share(sim)
        ax.set_title(
            f"{sim.name or 'simulation'}\n"
            f"simulated epoch {_fmt_seconds(sim.seconds)} = {_fmt_gpu_time(sim.gpu_hours)}, "
            f"idle {idle.sum() / max(busy.sum(), 1e-30):.1%}\n"
            f"micro-steps {s}-{s + k - 1} of {sim.micro_seconds.size}: {_fmt_count(tokens)} tokens "
            f"in {_fmt_seconds(float(sim.micro_seconds[s : s + k].sum()))}",
            fontsize=9.5,
        )
        if i % ncols == 0:
            ax.set_ylabel("rank")
        if i >= n - ncols:
            ax.set_xlabel(f"simulated time ({unit})")
    for ax in axes[n:]:
        ax.set_visible(False)
    axes[0].set_xlim(0, span * scale * 1.01)
    first = sims[0]
    note = (
        "black lines separate micro-steps; top labels: pack length and SP degree of the level trained; "
        "gradient sync not drawn"
    )
    title = (
        f"Per-rank timeline of consecutive micro-steps of {first.cost.model.name}, simulated on "
        f"{first.plan.world_size} x {first.cost.hardware.name} (cost model, not measured)"
    )
    width = int((5.4 * ncols + 0.6) * 11)  # characters of 10.5 pt text across the figure
    fig.suptitle("\n".join(textwrap.wrap(title, width) + textwrap.wrap(f"({note})", width)), fontsize=10.5)
    handles = [Patch(color=PART_COLORS[p], label=PART_LABELS[p]) for p in TIMELINE_PARTS]
    _legend_below(fig, handles, fontsize=9, max_cols=len(handles))
    return fig


# --------------------------------------------------------------------------------------------
# Length histogram
# --------------------------------------------------------------------------------------------


def sample_levels(plan: Plan) -> np.ndarray:
    """The level of the pack that holds each sample, or -1 for samples never packed."""
    out = np.full(plan.lengths.size, -1, dtype=np.int64)
    out[plan.members] = np.repeat(plan.pack_level, np.diff(plan.offsets))
    return out


def _length_bins(x: np.ndarray, bounds: Sequence[int], n: int = 60) -> np.ndarray:
    """Log-spaced bin edges over ``x`` with an edge just above every level bound, so no bin mixes
    the samples of two levels (level i holds lengths up to and including its pack length)."""
    lo, hi = float(x.min()), float(max(x.max(), max(bounds))) * 1.02
    edges = np.geomspace(lo, hi, n)
    cuts = np.array([b + 0.5 for b in bounds if lo < b + 0.5 < hi])
    if cuts.size:
        step = np.log(hi / lo) / (n - 1)
        near = (np.abs(np.log(edges[:, None] / cuts[None, :])) < step / 3).any(axis=1)
        near[[0, -1]] = False
        edges = np.unique(np.r_[edges[~near], cuts])
    return edges


@FuncFormatter
def _minor_log_labels(v: float, _pos) -> str:
    """Labels for the minor ticks of a short log axis: 2, 3 and 5 times a power of ten."""
    if v < 1:
        return ""
    lead = v / 10 ** math.floor(math.log10(v) + 1e-9)
    return f"{v:,.0f}" if any(abs(lead - d) < 1e-6 for d in (2, 3, 5)) else ""


def length_histogram_figure(plan: Plan, lengths=None) -> Figure:
    """Histogram of sample lengths (log bins), as sample counts and as tokens, coloured by the
    level each sample was packed into; ``lengths`` (default: the plan's) may give the lengths before
    truncation."""
    lens = plan.lengths if lengths is None else np.asarray(lengths)
    if lens.shape != plan.lengths.shape:
        raise ValueError(f"lengths has {lens.size} entries but the plan has {plan.lengths.size} samples")
    level_of = sample_levels(plan)
    x = np.maximum(lens, 1).astype(np.float64)
    bins = _length_bins(x, [lv.pack_len for lv in plan.levels])
    total_tokens = max(float(lens.sum()), 1.0)

    series = []  # (lengths, colour, legend label)
    for i, lv in enumerate(plan.levels):
        info = plan.report["levels"][i]
        sel = level_of == i
        filled = f" ({info['filled_from_below']:,} filled in from smaller levels)" if info["filled_from_below"] else ""
        label = (
            f"level {i}: {_fmt_tokens(lv.pack_len)} packs, sp {lv.sp}, ckpt {lv.ckpt_layers} layers: "
            f"{info['samples']:,} samples{filled}, {lens[sel].sum() / total_tokens:.1%} of tokens, "
            f"fill {_fmt_fill(info['fill'])}"
        )
        series.append((x[sel], LEVEL_COLORS[i % len(LEVEL_COLORS)], label))
    unpacked = level_of < 0
    if unpacked.any():
        zero = int((lens[unpacked] == 0).sum())
        over = int(unpacked.sum()) - zero
        parts = [f"{over:,} dropped (longer than {_fmt_tokens(plan.levels[-1].pack_len)})"] if over else []
        parts += [f"{zero:,} zero-length (drawn at 1 token)"] if zero else []
        series.append((x[unpacked], UNPACKED_COLOR, "not packed: " + ", ".join(parts)))

    plain = FuncFormatter(lambda v, _: f"{v:,.0f}")
    fig = _new_figure(11.0, 7.4)
    ax_n, ax_t = fig.subplots(2, 1, sharex=True, height_ratios=(1.25, 1))
    # Opaque layers, the most numerous behind: on a log count axis the few samples GreedyFill moved
    # into a larger level stay visible in front of the many that fill their own level.
    for rank, (xs, color, _) in enumerate(sorted(series, key=lambda t: -t[0].size)):
        for ax, weights in ((ax_n, None), (ax_t, xs)):
            alpha = 0.55 if rank == 0 else 0.8
            ax.hist(xs, bins=bins, weights=weights, histtype="stepfilled", color=color, alpha=alpha, zorder=2 + rank)
            ax.hist(xs, bins=bins, weights=weights, histtype="step", color=color, linewidth=1.4, zorder=2 + rank)
    handles = [Patch(facecolor=color, edgecolor=color, alpha=0.7, label=label) for _, color, label in series]
    for i, lv in enumerate(plan.levels):
        color = LEVEL_COLORS[i % len(LEVEL_COLORS)]
        for ax in (ax_n, ax_t):
            ax.axvline(lv.pack_len, color=color, linestyle="--", linewidth=1.2, zorder=20)
        ax_n.annotate(
            _fmt_tokens(lv.pack_len),
            (lv.pack_len, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
            color=color,
        )
    handles.append(Line2D([], [], color="black", linestyle="--", label="pack length of a level (its upper bound)"))
    ax_n.set_xscale("log")
    ax_n.set_yscale("log")
    ax_n.set_ylim(bottom=0.5)  # a bin holding one sample still shows as a bar
    ax_n.set_ylabel("samples per bin (log scale)")
    ax_n.yaxis.set_major_formatter(plain)
    ax_n.yaxis.set_minor_formatter(_minor_log_labels if ax_n.get_ylim()[1] < 30 else NullFormatter())
    ax_t.set_ylabel("tokens per bin")
    ax_t.yaxis.set_major_formatter(EngFormatter())
    ax_t.set_xlabel("sample length (tokens, log scale)")
    ax_t.xaxis.set_major_formatter(plain)
    # Label the minor ticks too when the lengths span less than two decades (else they crowd).
    ax_t.xaxis.set_minor_formatter(_minor_log_labels if bins[-1] / bins[0] < 100 else NullFormatter())
    for ax in (ax_n, ax_t):
        ax.grid(True, which="major", alpha=0.25)
    fig.suptitle(
        f"Sample lengths by packing level: {lens.size:,} samples ({int((level_of >= 0).sum()):,} packed), "
        f"{_fmt_count(float(lens.sum()))} tokens, world {plan.world_size}\n"
        "(a sample is coloured by the level of the pack that holds it: GreedyFill moves short samples into "
        "larger levels' free space)",
        fontsize=10.5,
    )
    _legend_below(fig, handles, fontsize=8.5, max_cols=1)
    return fig


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def figure_paths(path: str | os.PathLike[str]) -> list[Path]:
    """Where ``save_figures`` writes: ``path``, with ``.png`` added when it has no suffix (as matplotlib adds
    it), and ``<stem>_lengths<suffix>`` beside it. A ValueError, before anything is simulated, for a suffix
    matplotlib cannot write or a path that is a folder or lies inside a file (savefig would stop on it with a
    traceback after the whole run)."""
    given = Path(path)
    path = given if given.suffix else given.with_suffix(".png")
    formats = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ValueError(
            f"{path}: matplotlib writes no {path.suffix} pictures: end it in one of {', '.join(sorted(formats))}"
        )
    hist = path.with_name(f"{path.stem}_lengths{path.suffix}")
    for out in (given, path, hist):
        if out.is_dir():
            raise ValueError(f"{out} is a folder: give a picture file's name, e.g. {out / 'timeline.png'}")
    there = next(p for p in path.parents if p.exists())
    if not there.is_dir():
        raise ValueError(f"{path}: {there} is a file, so no picture can be written under it")
    return [path, hist]


def save_figures(path: str | os.PathLike[str], sims: Sequence[Simulation], plan: Plan) -> list[Path]:
    """Write the timeline of ``sims`` and the length histogram of ``plan`` where ``figure_paths`` says;
    returns both paths (those written, so a caller names the files that exist)."""
    paths = figure_paths(path)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for fig, out in zip((timeline_figure(sims), length_histogram_figure(plan)), paths):
        fig.savefig(out)
        fig.clear()
    return paths


def cp_balance_figure(packs: dict[str, np.ndarray], cps: Sequence[int] = (4, 8)) -> Figure:
    """Per-rank causal attention area of context-parallel splits, one panel per (pack, cp): each CP
    rank's area over the mean for the contiguous split (rank r holds tokens [r T / cp, (r + 1) T /
    cp)) beside the planner's ``split_pack``. ``packs``: a title -> document lengths (their sum a
    multiple of every cp). Shows why CP needs balancing at all: a contiguous split gives the last
    rank of a long document (2 cp - 1) / cp times the mean."""
    from lit_hbp.packing.context_split import contiguous_split, split_pack

    fig = _new_figure(4.2 * len(cps), 3.0 * len(packs))
    axes = fig.subplots(len(packs), len(cps), squeeze=False)
    for row, (title, docs) in enumerate(packs.items()):
        for col, cp in enumerate(cps):
            ax = axes[row][col]
            ranks = np.arange(cp)
            for shift, (name, split, color) in enumerate(
                (("contiguous", contiguous_split(docs, cp), "#D62728"), ("split_pack", split_pack(docs, cp), "#3A6FB0"))
            ):
                area = split.area_per_rank().astype(np.float64)
                ax.bar(ranks + (shift - 0.5) * 0.4, area / area.mean(), width=0.4, color=color,
                       label=f"{name} (worst {split.imbalance():.2f}x)")  # fmt: skip
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_xticks(ranks)
            ax.set_xlabel("CP rank")
            ax.set_ylabel("causal attention area / mean")
            ax.set_title(f"{title}, cp {cp}", fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig

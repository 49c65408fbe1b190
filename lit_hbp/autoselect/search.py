"""Hierarchical Groups Auto-Selection: the paper's Algorithms 1, 3 and 4 (docs/design.md section 8).

Algorithm 4 (checkpointing): profile memory with c_min and c_max checkpointed layers, interpolate
linearly the smallest count that leaves ``margin`` bytes free. Algorithm 3: for every SP layout
(sp, cp) = (ulysses x cp, cp), that checkpointing, then keep the (sp, cp, ckpt) with the most tokens
per second per device.
Algorithm 1: stage 1 runs Algorithm 3 for every candidate pack length and keeps the fastest
(l_best) and the largest (l_max); stage 2 adds l1 = l_best / sp_best (short samples stay whole on
one rank, no SP traffic) and l2 = l_max / sp_max when l2 > l_best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from lit_hbp.autoselect.profiler import AnalyticProfiler, Measurement, Profiler
from lit_hbp.packing.levels import LAYOUT_KINDS, Level
from lit_hbp.parallel.context_parallel import ContextParallel
from lit_hbp.parallel.groups import as_layout
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import default_layout

GIB = 1024**3


@dataclass(frozen=True)
class Candidate:
    pack_len: int
    sp: int
    ckpt_layers: int | None
    measurement: Measurement | None
    note: str = ""
    cp: int = 1
    offload: bool = False
    tiles: int = 1

    @property
    def layout(self) -> str:
        return str(self.sp) if self.cp == 1 else f"{self.sp}={self.sp // self.cp}x{self.cp}"

    @property
    def memory_note(self) -> str:
        return (" offload" if self.offload else "") + (f" tiles {self.tiles}" if self.tiles > 1 else "")

    @property
    def tokens_per_second(self) -> float:
        return self.measurement.tokens_per_second if self.measurement is not None else 0.0


@dataclass
class Selection:
    levels: list[Level]
    candidates: list[Candidate] = field(default_factory=list)
    best: Candidate | None = None
    largest: Candidate | None = None
    notes: list[str] = field(default_factory=list)
    """What the levels leave out: samples longer than a capped largest level."""

    def table(self) -> str:
        head = f"{'pack_len':>9} {'sp=UxCP':>8} {'ckpt':>5} {'step_s':>9} {'mem_GiB':>8} {'tok/s/dev':>10}  note"
        rows = [head, "-" * len(head)]
        for c in self.candidates:
            m = c.measurement
            mem = "-" if m is None or m.memory is None else f"{m.memory / GIB:.1f}"
            sec = "-" if m is None or not math.isfinite(m.seconds) else f"{m.seconds:.3f}"
            ck = "-" if c.ckpt_layers is None else str(c.ckpt_layers)
            note = (
                c.memory_note.strip() + "; " + c.note if c.memory_note and c.note else c.memory_note.strip() or c.note
            )
            rows.append(f"{c.pack_len:>9} {c.layout:>8} {ck:>5} {sec:>9} {mem:>8} {c.tokens_per_second:>10.0f}  {note}")
        return "\n".join(rows)

    def yaml(self) -> str:
        lines = ["levels:"]
        for lv in self.levels:
            if lv.sp_kind in LAYOUT_KINDS:
                u, cp = lv.layout
                kind = f", ulysses: {u}, cp: {cp}" if cp > 1 else ""
            else:
                kind = f", sp_kind: {lv.sp_kind}" if lv.sp > 1 else ""
            memory = (", offload: true" if lv.offload else "") + (
                f", mlp_tiles: {lv.mlp_tiles}" if lv.mlp_tiles > 1 else ""
            )
            lines.append(f"  - {{pack_len: {lv.pack_len}, sp: {lv.sp}, ckpt_layers: {lv.ckpt_layers}{memory}{kind}}}")
        return "\n".join(lines) + "\n"


def greedy_profile_ckpt(
    profiler: Profiler, pack_len: int, sp: int, c_min: int, c_max: int, margin: float = 0.0, cp: int = 1
) -> tuple[int | None, list[Candidate]]:
    """Algorithm 4: the fewest checkpointed layers that fit, by linear interpolation of memory.

    Returns (layers or None when even c_max does not fit, the measurements taken)."""
    trace = []

    def probe(c: int) -> Measurement:
        m = profiler.measure(pack_len, sp, c, cp)
        trace.append(Candidate(pack_len, sp, c, m, "memory probe", cp))
        return m

    def remaining(m: Measurement) -> float | None:
        return None if m.memory is None else profiler.capacity - m.memory

    low = probe(c_min)
    if low.fits and remaining(low) >= margin:
        return c_min, trace
    high = probe(c_max) if c_max != c_min else low
    r_high = remaining(high)
    if not high.fits or r_high is None or r_high < margin:
        return None, trace
    r_low = remaining(low)
    if r_low is None:  # a real OOM at c_min: no memory figure to interpolate from; bisect instead
        lo, hi = c_min, c_max
        while hi - lo > 1:
            mid = (lo + hi) // 2
            m = probe(mid)
            lo, hi = (lo, mid) if m.fits and remaining(m) >= margin else (mid, hi)
        return hi, trace
    slope = (r_high - r_low) / (c_max - c_min)
    c = min(max(math.ceil(c_max - (r_high - margin) / slope), c_min), c_max)
    while c < c_max:  # the interpolation is linear; confirm it and step up if it fell short
        m = probe(c)
        if m.fits and remaining(m) >= margin:
            break
        c += 1
    return c, trace


TILE_STEPS = (2, 4, 8, 16, 32, 64)
"""MLP tile counts the search tries, in order, once offload alone is not enough."""


@dataclass(frozen=True)
class MemoryFit:
    """How a level fits: checkpointed layers, offload, MLP tiles."""

    ckpt: int
    offload: bool = False
    tiles: int = 1


def fit_memory(
    profiler: Profiler, pack_len: int, sp: int, c_min: int, c_max: int, margin: float = 0.0, cp: int = 1
) -> tuple[MemoryFit | None, list[Candidate]]:
    """The paper's Algorithm 4 (the fewest checkpointed layers that fit), then, when every layer
    checkpointed is not enough and the profiler prices them (``memory_settings``): offload of the
    checkpointed inputs, then offload with the fewest MLP tiles (``TILE_STEPS``) that fit."""
    ckpt, trace = greedy_profile_ckpt(profiler, pack_len, sp, c_min, c_max, margin, cp)
    if ckpt is not None:
        return MemoryFit(ckpt), trace
    if not getattr(profiler, "memory_settings", False) or c_max == 0:
        return None, trace
    steps = TILE_STEPS if getattr(profiler, "tiles_allowed", True) else ()
    for tiles in (1, *steps):
        if tiles > pack_len // sp:
            break
        m = profiler.measure(pack_len, sp, c_max, cp, offload=True, tiles=tiles)
        trace.append(Candidate(pack_len, sp, c_max, m, "memory probe", cp, True, tiles))
        if m.fits and m.memory is not None and profiler.capacity - m.memory >= margin:
            return MemoryFit(c_max, True, tiles), trace
    return None, trace


@dataclass(frozen=True)
class Placement:
    """Where a level fits: its (sp, cp) layout, how (``MemoryFit``) and its predicted peak bytes."""

    sp: int
    cp: int
    fit: MemoryFit
    memory: float

    def describe(self, capacity: float) -> str:
        """``74.2 of 74.5 GiB at sp 8, ckpt 32, offload, mlp_tiles 4``: what a refusal quotes."""
        layout = f"sp {self.sp}" + (f" (ulysses {self.sp // self.cp} x cp {self.cp})" if self.cp > 1 else "")
        how = f"ckpt {self.fit.ckpt}" + (", offload" if self.fit.offload else "")
        how += f", mlp_tiles {self.fit.tiles}" if self.fit.tiles > 1 else ""
        return f"{self.memory / GIB:.1f} of {capacity / GIB:.1f} GiB at {layout}, {how}"


def fit_anywhere(profiler, pack_len: int, layouts, layers: int, margin: float = 0.0) -> Placement | None:
    """The first layout, fewest ranks first, in which ``pack_len`` fits (``fit_memory``: checkpointing,
    then offload, then MLP tiles), or None: the search's question for its largest level, asked of
    memory alone so that it can be asked first and again with each lever (``levers.py``)."""
    for sp, cp in sorted(as_layout(x) for x in layouts):
        if pack_len % sp:
            continue
        fit, _ = fit_memory(profiler, pack_len, sp, 0, layers, margin, cp)
        if fit is not None:
            settings = dict(offload=True, tiles=fit.tiles) if fit.offload else {}
            return Placement(sp, cp, fit, profiler.measure(pack_len, sp, fit.ckpt, cp, **settings).memory)
    return None


class LargestDoesNotFit(ValueError):
    """Algorithm 1's largest pack length fits in no layout the profiler tried."""


def find_best_sp_ckpt(
    profiler: Profiler, pack_len: int, sp_candidates, c_min: int, c_max: int, margin: float = 0.0
) -> tuple[Candidate | None, list[Candidate]]:
    """Algorithm 3: the (sp, cp, ckpt) with the most tokens per second per device at ``pack_len``;
    ``sp_candidates`` are degrees (Ulysses) or (sp, cp) layouts."""
    rows = []
    best = None
    for layout in sp_candidates:
        sp, cp = as_layout(layout)
        if pack_len % sp:
            continue
        fit, trace = fit_memory(profiler, pack_len, sp, c_min, c_max, margin, cp)
        if fit is None:
            extra = ", offloaded and tiled" if getattr(profiler, "memory_settings", False) else ""
            oom = f"OOM even with all layers checkpointed{extra}"
            rows.append(Candidate(pack_len, sp, None, trace[-1].measurement, oom, cp))
            continue
        settings = dict(offload=fit.offload, tiles=fit.tiles) if fit.offload else {}
        m = profiler.measure(pack_len, sp, fit.ckpt, cp, **settings)
        cand = Candidate(pack_len, sp, fit.ckpt, m, "", cp, fit.offload, fit.tiles)
        rows.append(cand)
        if best is None or cand.tokens_per_second > best.tokens_per_second:
            best = cand
    if best is not None:
        rows = [replace(c, note="best" if c is best else c.note) for c in rows]
        best = next(c for c in rows if c.note == "best")
    return best, rows


def auto_select(
    profiler: Profiler,
    pack_lens,
    sp_candidates,
    num_layers: int,
    c_min: int = 0,
    margin: float = 0.0,
    sp_kind: str = "ulysses",
) -> Selection:
    """Algorithm 1: levels (pack_len, sp, ckpt_layers) for the data, model and hardware; levels with
    sp > 1 split their packs the ``sp_kind`` way."""
    pack_lens = sorted(set(int(x) for x in pack_lens))
    candidates, results = [], {}
    for length in pack_lens:
        best, rows = find_best_sp_ckpt(profiler, length, sp_candidates, c_min, num_layers, margin)
        candidates += rows
        results[length] = best
    largest = results[pack_lens[-1]]
    if largest is None:
        raise LargestDoesNotFit(
            f"the largest pack length {pack_lens[-1]} fits with no sp in {list(sp_candidates)}: more GPUs per "
            "SP group or a smaller largest level are needed"
        )
    feasible = {k: v for k, v in results.items() if v is not None}
    best = max(feasible.values(), key=lambda c: c.tokens_per_second)
    # Stage 2: keep short samples whole on one rank, and add the largest level's per-rank length.
    lengths = {best.pack_len: best, largest.pack_len: largest}
    l1 = best.pack_len // best.sp
    l2 = largest.pack_len // largest.sp
    extra = [l1] + ([l2] if l2 > best.pack_len else [])
    for length in extra:
        if length in lengths:
            continue
        if length == l1:
            fit, trace = fit_memory(profiler, l1, 1, c_min, num_layers, margin)
            candidates += trace
            if fit is None:
                continue
            settings = dict(offload=True, tiles=fit.tiles) if fit.offload else {}
            m = profiler.measure(l1, 1, fit.ckpt, **settings)
            note = "stage 2: l1 = l_best / sp_best"
            lengths[l1] = Candidate(l1, 1, fit.ckpt, m, note, 1, fit.offload, fit.tiles)
        else:
            cand, rows = find_best_sp_ckpt(profiler, length, sp_candidates, c_min, num_layers, margin)
            candidates += rows
            if cand is not None:
                lengths[length] = cand
    levels = [candidate_level(c, sp_kind) for _, c in sorted(lengths.items())]
    return Selection(levels, candidates, best, largest)


def candidate_level(c: Candidate, sp_kind: str) -> Level:
    """The level of a chosen candidate, with its (ulysses, cp) layout when it has CP (plain Ulysses
    is what a level without a layout resolves to wherever the heads allow it)."""
    memory = dict(offload=c.offload, mlp_tiles=c.tiles)
    if sp_kind in LAYOUT_KINDS and c.cp > 1:
        return Level(c.pack_len, c.sp, c.ckpt_layers, ulysses=c.sp // c.cp, cp=c.cp, **memory)
    if sp_kind in LAYOUT_KINDS:
        return Level(c.pack_len, c.sp, c.ckpt_layers, **memory)
    return Level(c.pack_len, c.sp, c.ckpt_layers, sp_kind=sp_kind, **memory)


def covering_length(lengths, max_len: int | None = None) -> int:
    """The largest level: the first power of two that holds the longest sample, or ``max_len`` (the
    user's cap, the model's positions) when that is shorter: every sample up to the cap is kept."""
    top = 1 << (max(int(np.max(lengths)), 2) - 1).bit_length()
    return top if max_len is None else min(top, int(max_len))


def default_candidates(lengths, largest: int | None = None) -> list[int]:
    """Pack lengths to try: powers of two from 8K (less for short data) up to the first power of
    two that holds the longest sample, or up to ``largest`` (which is always included)."""
    top = largest or covering_length(lengths)
    out, x = [], min(8192, top)
    while x < top:
        out.append(x)
        x *= 2
    return out + [top]


def level_candidates(lengths, top: int, candidates=None, max_len: int | None = None) -> list[int]:
    """The pack lengths Algorithm 1 prices: the user's ``candidates`` (none above ``max_len``), with
    ``top`` added when none of them holds the longest sample up to the cap; else the defaults."""
    if not candidates:
        return default_candidates(lengths, top)
    out = sorted({int(c) for c in candidates if max_len is None or c <= max_len})
    if not out or out[-1] < min(int(np.max(lengths)), top):
        out = sorted({*out, top})
    return out


def sp_candidates(
    world: int,
    heads: int,
    kv_heads: int,
    kind: str = "ulysses",
    every_layout: bool = True,
    node_size: int | None = None,
) -> list[tuple[int, int]]:
    """The (sp, cp) layouts to try on this world (powers of two). The built-in kinds offer every
    layout whose Ulysses part the heads allow (plain Ulysses is cp 1), or with ``every_layout``
    False only the default one per degree on nodes of ``node_size`` ranks (Ulysses as large as the
    heads and a node allow, CP the rest: fewer probes for a measured search); a kind of one's own
    its ``layouts``."""
    if kind not in LAYOUT_KINDS:
        return resolve_sp_kind(kind).layouts(world, heads, kv_heads)
    layouts = ContextParallel().layouts(world, heads, kv_heads)
    if every_layout:
        return layouts
    return sorted({(sp, default_layout(sp, heads, kv_heads, node_size)[1]) for sp, _ in layouts})


def select_levels(
    profiler: Profiler,
    lengths,
    model,
    world: int,
    max_len: int | None = None,
    candidates=None,
    margin: float = 0.0,
    sp_kind: str = "ulysses",
    every_layout: bool = True,
    node_size: int | None = None,
    cost=None,
) -> Selection:
    """The level search every tool runs (``simulate``, ``autoselect``, the selectors of a fit):
    Algorithm 1 over pack lengths up to the one that holds the longest sample (``covering_length``,
    capped at ``max_len``) for this model (a ModelSpec) and world, on the SP layouts of
    ``sp_candidates``, each with the fewest checkpointed layers, then offload, then MLP tiles that fit.

    It keeps every sample or refuses: when the largest level fits no layout, it raises
    ``levers.NoLevelFits`` naming what would make it fit (with ``cost``, the run's cost model: each
    lever found by running the memory search with it), before pricing anything where the profiler
    answers memory analytically. Samples above ``max_len`` are the caller's to truncate or drop
    (``Selection.notes`` counts them)."""
    from lit_hbp.autoselect.levers import FitQuestion, refusal  # levers builds on this module

    top = covering_length(lengths, max_len)
    cands = level_candidates(lengths, top, candidates, max_len)
    layouts_of = partial(
        sp_candidates,
        heads=model.heads,
        kv_heads=model.kv_heads,
        kind=sp_kind,
        every_layout=every_layout,
        node_size=node_size,
    )
    analytic = getattr(profiler, "memory_settings", False)
    question = None if cost is None else FitQuestion(cost, layouts_of, margin, profiler.capacity, analytic)
    if question is not None and analytic and question.where(cands[-1]) is None:
        raise refusal(question, cands[-1], lengths)
    try:
        selection = auto_select(profiler, cands, layouts_of(world), model.layers, 0, margin, sp_kind)
    except LargestDoesNotFit:
        if question is None:
            raise
        raise refusal(question, cands[-1], lengths) from None
    selection.notes = beyond_notes(lengths, selection.levels[-1].pack_len)
    return selection


def beyond_notes(lengths, largest: int) -> list[str]:
    """What a selection leaves to ``data.over_length``: the samples longer than its largest level."""
    lengths = np.asarray(lengths)
    over = lengths[lengths > largest]
    if not over.size:
        return []
    return [
        f"{over.size:,} sample{'' if over.size == 1 else 's'} ({int(over.sum()):,} tokens, the longest "
        f"{int(over.max()):,}) {'is' if over.size == 1 else 'are'} longer than the "
        f"largest level ({largest:,} tokens, the cap): data.over_length truncates, drops or refuses them"
    ]


def analytic_levels(
    cost,
    lengths,
    seed: int = 0,
    max_len: int | None = None,
    candidates=None,
    margin: float = 0.0,
    sp_kind: str = "ulysses",
    node_size: int | None = None,
) -> Selection:
    """``select_levels`` priced by the cost model of the run (``AnalyticProfiler``): what
    ``python -m lit_hbp.simulate`` auto-selects and ``AnalyticSelector`` (``python -m
    lit_hbp.autoselect --analytic``, a fit with analytic levels) chooses, from the same arguments."""
    profiler = AnalyticProfiler(cost, lengths, seed)
    return select_levels(
        profiler, lengths, cost.model, cost.world, max_len, candidates, margin, sp_kind, True, node_size, cost
    )

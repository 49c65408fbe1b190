"""Hierarchical Groups Auto-Selection: the paper's Algorithms 1 and 3 (docs/design.md section 8), over
Algorithm 4 and the memory settings beyond it (``memory_fit``), and the one level search every tool runs
(``select_levels``), which refuses with the levers that would make its largest level fit (``levers``).

Algorithm 3: for every SP layout (sp, cp) = (ulysses x cp, cp), the fewest checkpointed layers that fit
(Algorithm 4), then keep the (sp, cp, ckpt) with the most tokens per second per device.
Algorithm 1: stage 1 runs Algorithm 3 for every candidate pack length and keeps the fastest
(l_best) and the largest (l_max); stage 2 adds l1 = l_best / sp_best (short samples stay whole on
one rank, no SP traffic) and l2 = l_max / sp_max when l2 > l_best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from lit_hbp.autoselect.levers import FitQuestion, no_level_fits
from lit_hbp.autoselect.memory_fit import TILE_STEPS as TILE_STEPS  # the tile counts, where bench/ reads them
from lit_hbp.autoselect.memory_fit import fit_memory, layouts_at
from lit_hbp.autoselect.profiler import AnalyticProfiler, Candidate, Profiler
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import GIB
from lit_hbp.cost.run_settings import CONFIG, Tool
from lit_hbp.errors import ConfigError
from lit_hbp.packing.levels import LAYOUT_KINDS, Level
from lit_hbp.packing.vision_load import VisionLoad
from lit_hbp.parallel.context_parallel import ContextParallel
from lit_hbp.parallel.groups import as_layout
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import default_layout


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
                kind = f", ulysses: {u}, cp: {cp}" if lv.sp > 1 and lv.cp is not None else ""  # the layout priced
            else:
                kind = f", sp_kind: {lv.sp_kind}" if lv.sp > 1 else ""
            memory = (", offload: true" if lv.offload else "") + (
                f", mlp_tiles: {lv.mlp_tiles}" if lv.mlp_tiles > 1 else ""
            )
            batch = f", packs_per_rank: {lv.packs_per_rank}" if lv.packs_per_rank > 1 else ""
            lines.append(
                f"  - {{pack_len: {lv.pack_len}, sp: {lv.sp}, ckpt_layers: {lv.ckpt_layers}{batch}{memory}{kind}}}"
            )
        return "\n".join(lines) + "\n"


class LargestDoesNotFit(ValueError):
    """Algorithm 1's largest pack length fits in no layout the profiler tried."""


def find_best_sp_ckpt(
    profiler: Profiler,
    pack_len: int,
    sp_candidates,
    c_min: int,
    c_max: int,
    margin: float = 0.0,
    whole_past: int | None = None,
) -> tuple[Candidate | None, list[Candidate]]:
    """Algorithm 3: the (sp, cp, ckpt) with the most tokens per second per device at ``pack_len``;
    ``sp_candidates`` are degrees (Ulysses) or (sp, cp) layouts, only sp 1 past ``whole_past``."""
    rows = []
    best = None
    for layout in layouts_at(sp_candidates, pack_len, whole_past):
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
    whole_past: int | None = None,
) -> Selection:
    """Algorithm 1: levels (pack_len, sp, ckpt_layers) for the data, model and hardware; levels with
    sp > 1 split their packs the ``sp_kind`` way; levels past ``whole_past`` tokens stay at sp 1."""
    pack_lens = sorted(set(int(x) for x in pack_lens))
    candidates, results = [], {}
    for length in pack_lens:
        best, rows = find_best_sp_ckpt(profiler, length, sp_candidates, c_min, num_layers, margin, whole_past)
        candidates += rows
        results[length] = best
    largest = results[pack_lens[-1]]
    if largest is None:
        raise LargestDoesNotFit(
            f"the largest pack length {pack_lens[-1]} fits with no sp in "
            f"{layouts_at(sp_candidates, pack_lens[-1], whole_past)}: more GPUs per SP group or a smaller largest "
            "level are needed"
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
            cand, rows = find_best_sp_ckpt(profiler, length, sp_candidates, c_min, num_layers, margin, whole_past)
            candidates += rows
            if cand is not None:
                lengths[length] = cand
    levels = [candidate_level(c, sp_kind) for _, c in sorted(lengths.items())]
    return Selection(levels, candidates, best, largest)


def candidate_level(c: Candidate, sp_kind: str) -> Level:
    """The level of a chosen candidate, with the (ulysses, cp) layout it was priced at whenever it has SP: a level
    without one resolves to the run's default layout on its nodes, which may be another (one the search found out
    of memory)."""
    memory = dict(offload=c.offload, mlp_tiles=c.tiles)
    if sp_kind in LAYOUT_KINDS and c.sp > 1:
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
    """The pack lengths Algorithm 1 prices: the user's ``candidates`` (one above ``max_len`` refused: it was
    dropped without a word), with ``top`` added when none of them holds the longest sample up to the cap; else
    the defaults."""
    if not candidates:
        return default_candidates(lengths, top)
    over = sorted({int(c) for c in candidates if max_len is not None and c > max_len})
    if over:
        raise ConfigError(
            f"candidates {over} are longer than the longest level this search may choose, {max_len} tokens (the "
            "selector's max_len, or the model's positions): drop them, or raise max_len"
        )
    out = sorted({int(c) for c in candidates})
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


def _without_cp(layouts_of, world: int) -> list[tuple[int, int]]:
    """The layouts of ``layouts_of(world)`` without context parallelism: a model with stateful token mixers
    (``ModelSpec.mixing``: Falcon-H1's beside attention in every layer too) runs them document by document, which a
    CP shard cannot (``SPKind.mixer_problem``); a router loss (``ModelSpec.router_loss``) is over the whole pack's
    tokens, which a CP shard does not gather; chunked attention (Llama 4's) cuts each document into chunks, which a
    CP shard's ranges do not (long levels are where CP would be chosen)."""
    return [(sp, cp) for sp, cp in layouts_of(world) if cp == 1]


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
    cost: CostModel | None = None,
    tool: Tool = CONFIG,
    whole_past: int | None = None,
) -> Selection:
    """The level search every tool runs (``simulate``, ``autoselect``, the selectors of a fit):
    Algorithm 1 over pack lengths up to the one that holds the longest sample (``covering_length``,
    capped at ``max_len``) for this model (a ModelSpec) and world, on the SP layouts of
    ``sp_candidates``, each with the fewest checkpointed layers, then offload, then MLP tiles that fit.

    It keeps every sample or refuses: when the largest level fits no layout, it raises
    ``levers.NoLevelFits`` naming what would make it fit in ``tool``'s words (with ``cost``, the run's cost
    model, ``run_settings.cost_model``: each lever found by running the memory search with it), before
    pricing anything where the profiler answers memory analytically. Samples above ``max_len`` are the
    caller's to truncate or drop (``Selection.notes`` counts them). Levels past ``whole_past`` tokens (a
    longrope model's original positions, ``selector.whole_past``) stay at sp 1."""
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
    chunked = any(kind == "chunked" for kind, _ in model.attention_windows)  # Llama 4's: CP past a chunk refused
    if model.mixing or model.router_loss or chunked:  # a hybrid's mixers (beside attention too), a router loss
        layouts_of = partial(_without_cp, layouts_of)
    analytic = getattr(profiler, "memory_settings", False)
    question = None
    if cost is not None:
        question = FitQuestion(cost, layouts_of, margin, profiler.capacity, analytic, tool, whole_past)
    if question is not None and analytic and question.where(cands[-1]) is None:
        raise no_level_fits(question, cands[-1], lengths)
    try:
        selection = auto_select(profiler, cands, layouts_of(world), model.layers, 0, margin, sp_kind, whole_past)
    except LargestDoesNotFit:
        if question is None:
            raise
        raise no_level_fits(question, cands[-1], lengths) from None
    selection.notes = beyond_notes(lengths, selection.levels[-1].pack_len)
    if whole_past is not None and selection.levels[-1].pack_len > whole_past:
        selection.notes.append(
            f"levels past {whole_past:,} tokens stay at sp 1: past them the model's longrope rotary embedding "
            "takes each document's factors by its own length, which only a whole pack on one rank can give"
        )
    if cost is not None:
        selection.levels = fill_token_budget(selection.levels, cost, profiler.capacity, margin)
    return selection


def fill_token_budget(levels: list[Level], cost: CostModel, capacity: float, margin: float = 0.0) -> list[Level]:
    """Each level's micro-step filled toward the longest level's tokens per rank with ``packs_per_rank``
    (B packs side by side in one varlen row, each document still alone): the most packs, a power of two,
    whose tokens per rank stay within that budget and whose peak memory (the cost model's, with the
    level's checkpointing, offload and tiles) leaves ``margin`` of ``capacity`` free. A short level then
    does as much work per micro-step as the longest: the step's fixed costs (kernel launches, the
    optimizer's share, the loop's host work) spread over as many tokens, as the paper's larger local
    batch for short lengths does. Exactness is unchanged (the packs' documents attend to themselves
    only); a level given B > 1 keeps it."""
    if not levels:
        return levels
    budget = max(lv.pack_len * lv.packs_per_rank / lv.sp for lv in levels)
    out = []
    for lv in levels:
        b = lv.packs_per_rank
        if b == 1:
            per_pack = lv.pack_len / lv.sp
            b = 1 << max(int(budget // per_pack).bit_length() - 1, 0)
            cp = lv.layout[1]
            while b > 1:
                memory = cost.memory_bytes(lv.pack_len, lv.sp, lv.ckpt_layers, b, lv.offload, lv.mlp_tiles, cp)
                host = not lv.offload or cost.host_fits(lv.pack_len, lv.sp, lv.ckpt_layers, b)
                if memory <= capacity - margin and host:
                    break
                b //= 2
        out.append(replace(lv, packs_per_rank=b))
    return out


def with_vision(cost: CostModel, lengths, vision: VisionLoad | None) -> CostModel:
    """The run's cost model with the most image patches a token of its data brings (the memory a trained
    tower keeps, ``CostModel.vision_bytes``); refused where the data has images and the model no tower
    the cost model can price."""
    if vision is None:
        return cost
    if cost.model.vision is None:
        raise ValueError(
            f"the data has images or videos but the model {cost.model.name} has no vision_config the level "
            "search can price (its depth and width): give levels in the config instead of choosing them"
        )
    return replace(cost, vision_patches_per_token=vision.patches_per_token(lengths))


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
    cost: CostModel,
    lengths,
    seed: int = 0,
    max_len: int | None = None,
    candidates=None,
    margin: float = 0.0,
    sp_kind: str = "ulysses",
    node_size: int | None = None,
    tool: Tool = CONFIG,
    vision: VisionLoad | None = None,
    whole_past: int | None = None,
) -> Selection:
    """``select_levels`` priced by the cost model of the run (``AnalyticProfiler``): what
    ``python -m lit_hbp.simulate`` auto-selects and ``AnalyticSelector`` (``python -m
    lit_hbp.autoselect --analytic``, a fit with analytic levels) chooses, from the same arguments. With
    ``vision`` (a vision-language run's images, per sample) every candidate's time counts the tower's
    encoding and its memory what the tower keeps (``with_vision``)."""
    cost = with_vision(cost, lengths, vision)
    profiler = AnalyticProfiler(cost, lengths, seed, vision)
    return select_levels(
        profiler,
        lengths,
        cost.model,
        cost.world,
        max_len,
        candidates,
        margin,
        sp_kind,
        True,
        node_size,
        cost,
        tool,
        whole_past,
    )

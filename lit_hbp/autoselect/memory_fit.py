"""Does a level fit in memory, and how: the paper's Algorithm 4 (the fewest checkpointed layers that fit),
then offload, then MLP tiles; and the question for a whole world of (sp, cp) layouts (``fit_anywhere``),
which the level search asks first and its refusal (``levers``) asks again with each lever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lit_hbp.autoselect.profiler import Candidate, Measurement, Profiler
from lit_hbp.cost.hardware import GIB
from lit_hbp.parallel.groups import as_layout


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
    fits = lambda m: m.fits and remaining(m) >= margin  # noqa: E731
    guess = c
    while c < c_max and not fits(probe(c)):  # the interpolation is linear; confirm it, step up if it fell short
        c += 1
    # ... or down where it overshot: memory falls linearly with each layer checkpointed until all are, where
    # the last one's recompute buffers jump it, so the line through c_max can land a layer too high.
    while c == guess and c > c_min and fits(probe(c - 1)):
        c = guess = c - 1
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
    checkpointed inputs, then offload with the fewest MLP tiles (``TILE_STEPS``, where set-up accepts
    tiles: ``tiles_allowed``) that fit."""
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
        """``74.2 of 79.6 GiB at sp 8, ckpt 32, offload, mlp_tiles 4``: what a refusal quotes."""
        layout = f"sp {self.sp}" + (f" (ulysses {self.sp // self.cp} x cp {self.cp})" if self.cp > 1 else "")
        how = f"ckpt {self.fit.ckpt}" + (", offload" if self.fit.offload else "")
        how += f", mlp_tiles {self.fit.tiles}" if self.fit.tiles > 1 else ""
        return f"{self.memory / GIB:.1f} of {capacity / GIB:.1f} GiB at {layout}, {how}"


def layouts_at(layouts, pack_len: int, whole_past: int | None = None) -> list:
    """The ``layouts`` a level of ``pack_len`` may take: past ``whole_past`` only sp 1 (a longrope rotary
    embedding's original positions, past which each document's factors depend on its own length: a pack at
    sp 1 gives each its own, an SP group's ranks could not; ``checks.check_positions``)."""
    if whole_past is None or pack_len <= whole_past:
        return list(layouts)
    return [x for x in layouts if as_layout(x)[0] == 1]


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

"""Why a level does not fit, and what would make it fit: the level search's refusal.

A refusal never lists levers blindly. Each lever it names is the search's own memory question
(``search.fit_anywhere``: every (sp, cp) layout the world offers, fewest ranks first, each with
checkpointing, then offload, then MLP tiles) asked again with that lever, and quoted with the peak it
would reach: offload and tiles where the search in use leaves them out (a measured search), Liger's
RMSNorm/SwiGLU and the Adam states on the host (the fewest flags that do it), more GPUs (doubling
the world: larger SP groups, smaller ZeRO partitions), and a shorter largest level (the samples
beyond it then follow ``data.over_length``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from lit_hbp.autoselect.profiler import MemoryProfiler
from lit_hbp.autoselect.search import GIB, TILE_STEPS, Placement, fit_anywhere
from lit_hbp.costmodel import CostModel
from lit_hbp.packing.levels import Level
from lit_hbp.parallel.context_parallel import ContextParallel

MAX_LEVER_GPUS = 4096
"""The most GPUs a refusal looks for (doubling the run's world)."""

SHORTEST_LEVEL = 1024
"""The shortest largest level a refusal offers."""


@dataclass(frozen=True)
class Flag:
    """A run setting a refusal may name: the ``CostModel`` field it sets, and how the command lines
    and a training config spell it."""

    field: str
    cli: str
    config: str


FLAGS = (
    Flag("liger", "--liger", "model.liger: true"),
    Flag("optimizer_offload", "--offload-optimizer", "HBPStrategy offload_optimizer: true"),
)


def spell(flags: tuple[Flag, ...]) -> str:
    """``--liger --offload-optimizer (model.liger: true, HBPStrategy offload_optimizer: true)``."""
    return " ".join(f.cli for f in flags) + " (" + ", ".join(f.config for f in flags) + ")"


def flag_sets(cost: CostModel) -> list[tuple[Flag, ...]]:
    """The flags the run has not set, one at a time, then all together."""
    off = tuple(f for f in FLAGS if not getattr(cost, f.field))
    return [(f,) for f in off] + ([off] if len(off) > 1 else [])


def with_flags(cost: CostModel, flags: tuple[Flag, ...]) -> CostModel:
    return replace(cost, **{f.field: True for f in flags})


def every_layout(cost: CostModel) -> Callable[[int], list[tuple[int, int]]]:
    """The (sp, cp) layouts a world offers the model: every one its heads allow."""
    return lambda world: ContextParallel().layouts(world, cost.model.heads, cost.model.kv_heads)


@dataclass(frozen=True)
class FitQuestion:
    """Does a pack length fit this run: its cost model, the (sp, cp) layouts a world offers
    (``layouts_of``), the margin left free, the device's capacity (default the GPU's memory) and
    whether offload and MLP tiles may be used (``memory_settings``: False for a measured search)."""

    cost: CostModel
    layouts_of: Callable[[int], list]
    margin: float = 0.0
    capacity: float | None = None
    memory_settings: bool = True

    @property
    def device_bytes(self) -> float:
        return self.cost.hardware.memory_bytes if self.capacity is None else self.capacity

    def where(
        self, pack_len: int, cost: CostModel | None = None, memory_settings: bool | None = None
    ) -> Placement | None:
        """Where ``pack_len`` fits with this run's settings, or with ``cost`` (a lever) instead."""
        cost = cost or self.cost
        settings = self.memory_settings if memory_settings is None else memory_settings
        profiler = MemoryProfiler(cost, self.device_bytes, settings)
        return fit_anywhere(profiler, pack_len, self.layouts_of(cost.world), cost.model.layers, self.margin)


def settings_lever(q: FitQuestion, pack_len: int) -> list[str]:
    """Offload and MLP tiles, when the search in use does not try them (a measured one)."""
    if q.memory_settings or (where := q.where(pack_len, memory_settings=True)) is None:
        return []
    return [f"offload and MLP tiles, which the analytic search tries ({where.describe(q.device_bytes)})"]


def flag_levers(q: FitQuestion, pack_len: int) -> list[str]:
    """Each smallest set of unset flags (Liger, optimizer offload) with which ``pack_len`` fits."""
    out, fitting = [], []
    for flags in flag_sets(q.cost):
        if any(set(done) <= set(flags) for done in fitting):
            continue
        if (where := q.where(pack_len, with_flags(q.cost, flags))) is not None:
            fitting.append(flags)
            out.append(f"{spell(flags)}: {where.describe(q.device_bytes)}")
    return out


def gpu_lever(q: FitQuestion, pack_len: int) -> list[str]:
    """The fewest GPUs (doubling the world, up to ``MAX_LEVER_GPUS``) with which ``pack_len`` fits:
    with the run's flags, else with every flag."""
    every = tuple(f for f in FLAGS if not getattr(q.cost, f.field))
    for flags in ((), every) if every else ((),):
        world = 2 * q.cost.world
        while world <= MAX_LEVER_GPUS:
            if (where := q.where(pack_len, replace(with_flags(q.cost, flags), world=world))) is not None:
                also = f" with {spell(flags)}" if flags else ""
                return [f"{world} GPUs{also} (--gpus {world}: {where.describe(q.device_bytes)})"]
            world *= 2
    return []


def shorter_lever(q: FitQuestion, pack_len: int, lengths) -> list[str]:
    """The longest power of two below ``pack_len`` that fits with the run's settings, and what it
    leaves to ``over_length``."""
    shorter = 1 << (int(pack_len).bit_length() - 1)
    shorter = shorter // 2 if shorter == pack_len else shorter
    while shorter >= SHORTEST_LEVEL and q.where(shorter) is None:
        shorter //= 2
    if shorter < SHORTEST_LEVEL:
        return []
    longer = np.asarray(lengths if lengths is not None else [], dtype=np.int64)
    longer = longer[longer > shorter]
    left = (
        f"; {samples(longer.size)} ({int(longer.sum()):,} tokens) above it left to data.over_length"
        if longer.size
        else ""
    )
    return [f"a largest level of {shorter:,} tokens (--max-len {shorter}, the selector's max_len{left})"]


def levers(q: FitQuestion, pack_len: int, lengths=None) -> list[str]:
    """What would make ``pack_len`` fit, each found by running the memory search with it, in the order
    a user reaches for them (``settings_lever``, ``flag_levers``, ``gpu_lever``, ``shorter_lever``)."""
    return (
        settings_lever(q, pack_len)
        + flag_levers(q, pack_len)
        + gpu_lever(q, pack_len)
        + shorter_lever(q, pack_len, lengths)
    )


def closest(q: FitQuestion, pack_len: int) -> str:
    """How far the run falls short: the least predicted peak over the layouts, with every layer
    checkpointed (offloaded, in the most tiles, where the search may)."""
    cost, layers = q.cost, q.cost.model.layers
    rows = []
    for sp, cp in q.layouts_of(cost.world):
        if pack_len % sp:
            continue
        tiles = min(TILE_STEPS[-1], pack_len // sp) if q.memory_settings and cost.zero_stage < 3 else 1
        rows.append((cost.memory_bytes(pack_len, sp, layers, 1, q.memory_settings, tiles, cp), sp, cp, tiles))
    if not rows:
        return f"no sp of {cost.world} GPUs divides it"
    memory, sp, cp, tiles = min(rows)
    how = ", offloaded" + (f", {tiles} MLP tiles" if tiles > 1 else "") if q.memory_settings else ""
    layout = f"sp {sp}" + (f" = ulysses {sp // cp} x cp {cp}" if cp > 1 else "")
    return (
        f"at best {memory / GIB:.1f} GiB per GPU at {layout} with all {layers} layers checkpointed{how}; "
        f"{q.device_bytes / GIB:.1f} GiB to use"
    )


def samples(n: int) -> str:
    return f"{n:,} sample" + ("" if n == 1 else "s")


def static_note(q: FitQuestion) -> str:
    """Why nothing fits at all: what the parameters, gradients and Adam states take before any token."""
    static = q.cost.static_bytes()
    return (
        f"the parameters, gradients and Adam states alone take {static / GIB:.1f} GiB per GPU under "
        f"ZeRO-{q.cost.zero_stage} on {q.cost.world} GPUs, {q.device_bytes / GIB:.1f} GiB to use: a higher ZeRO "
        "stage (HBPStrategy stage), or a smaller model"
    )


class NoLevelFits(ValueError):
    """The longest sample fits no level this run can train. The message (one line) says how far the
    run falls short and names the levers that would make it fit; ``pack_len`` and ``levers`` carry
    them for callers."""

    def __init__(self, message: str, pack_len: int, found: list[str]):
        super().__init__(message)
        self.pack_len, self.levers = pack_len, found


def refusal(q: FitQuestion, pack_len: int, lengths=None) -> NoLevelFits:
    """The error for a largest level of ``pack_len`` that fits no layout of the run, naming the levers."""
    hw, world = q.cost.hardware, q.cost.world
    flags = tuple(f for f in FLAGS if getattr(q.cost, f.field))
    with_ = f" with {' '.join(f.cli for f in flags)}" if flags else ""
    longest = f"the longest sample ({int(np.max(lengths)):,} tokens) needs " if lengths is not None else ""
    found = levers(q, pack_len, lengths)
    fix = "it fits with " + "; or ".join(found) if found else f"no lever makes any level fit: {static_note(q)}"
    where = f"{world} x {hw.name}{with_} ({closest(q, pack_len)})"
    return NoLevelFits(f"{longest}a {pack_len:,}-token level, which fits no sp of {where}: {fix}", pack_len, found)


def why_not_fits(cost: CostModel, level: Level) -> str:
    """What a level given by hand needs beyond the device with every layer checkpointed, offloaded and
    the MLP in the most tiles the search tries: the parts of its predicted memory, largest first; then
    the levers that make it fit (a larger sp, Liger, optimizer offload), each found by the search."""
    hw = cost.hardware
    tiles = min(TILE_STEPS[-1], level.pack_len // level.sp)
    layers, cp = cost.model.layers, level.layout[1]
    parts = cost.memory_parts(level.pack_len, level.sp, layers, level.packs_per_rank, True, tiles, cp)
    total = cost.memory_bytes(level.pack_len, level.sp, layers, level.packs_per_rank, True, tiles, cp)
    host = parts.pop("host") * hw.gpus_per_node
    if hw.host_memory_bytes and host > hw.host_memory_bytes and total <= hw.memory_bytes:
        return (
            f"its offloaded inputs need {host / GIB:.0f} GiB of host memory per node, the node has "
            f"{hw.host_memory_bytes / GIB:.0f} GiB"
        )
    top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
    larger = FitQuestion(cost, lambda w: [x for x in every_layout(cost)(w) if x[0] > level.sp])
    here = FitQuestion(cost, lambda w: [(level.sp, cp)])
    wider = larger.where(level.pack_len)
    found = ([f"a larger sp ({wider.describe(hw.memory_bytes)})"] if wider else []) + flag_levers(here, level.pack_len)
    fix = "it fits with " + "; or ".join(found) + "; or make it shorter" if found else "make it shorter"
    return (
        f"{total / GIB:.1f} GiB per GPU predicted with all {layers} layers checkpointed and offloaded and "
        f"{tiles} MLP tiles, the {hw.name} has {hw.memory_bytes / GIB:.1f} GiB ({top} GiB): {fix}"
    )

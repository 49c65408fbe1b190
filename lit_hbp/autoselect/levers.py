"""Why a level does not fit, and what would make it fit: the level search's refusal.

A refusal never lists levers blindly. Each lever it names is the search's own memory question
(``memory_fit.fit_anywhere``: every (sp, cp) layout the world offers, fewest ranks first, each with
checkpointing, then offload, then MLP tiles) asked again with that lever, and quoted with the peak it
would reach. Each is a setting set-up accepts beside the run's others (``run_settings.RULES``), spelled
as the tool that prints the refusal takes it (``run_settings.Tool``): offload and tiles where the search
in use leaves them out (a measured search), the fewest of Liger's RMSNorm/SwiGLU, the Adam states on the
host and a higher ZeRO stage, more GPUs (doubling the world: larger SP groups, smaller ZeRO partitions),
and a shorter largest level (the samples beyond it then follow ``data.over_length``); first, where the run
keeps a margin of memory free, the largest smaller one that fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import combinations

import numpy as np

from lit_hbp.autoselect.memory_fit import TILE_STEPS, Placement, fit_anywhere, layouts_at
from lit_hbp.autoselect.profiler import MemoryProfiler
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import GIB
from lit_hbp.cost.run_settings import CONFIG, SIMULATE, SWITCHES, Tool, problems, refusal
from lit_hbp.errors import ConfigError
from lit_hbp.packing.levels import Level
from lit_hbp.parallel.context_parallel import ContextParallel
from lit_hbp.parallel.groups import as_layout

MAX_LEVER_GPUS = 4096
"""The most GPUs a refusal looks for (doubling the run's world)."""

SHORTEST_LEVEL = 1024
"""The shortest largest level a refusal offers."""


@dataclass(frozen=True)
class Lever:
    """One way to make a level fit, found by asking the memory search with it: the run's settings it changes
    (``changes``: liger, optimizer_offload, zero_stage, world, as ``CostModel`` and ``Settings`` name them),
    the largest level it caps (``max_len``), the analytic search (``analytic``: offload and MLP tiles,
    which a measured search leaves out) or a smaller margin (``margin_gib``); ``text`` is how the refusal says it."""

    text: str
    changes: dict = field(default_factory=dict)
    max_len: int | None = None
    analytic: bool = False
    margin_gib: float | None = None  # a smaller margin kept free

    def __str__(self) -> str:
        return self.text


def setting_changes(cost: CostModel) -> list[dict]:
    """The changes of Liger, optimizer offload and ZeRO stage a refusal may name, fewest first: each unset
    flag, each higher stage and their combinations, less those set-up refuses (``run_settings.problems``)."""
    unset = [f for f in SWITCHES if not getattr(cost, f)]
    out = []
    for n in range(len(unset) + 1):
        for flags in combinations(unset, n):
            for stage in (None, *range(cost.zero_stage + 1, 4)):
                changes = {f: True for f in flags} | ({} if stage is None else {"zero_stage": stage})
                if changes and not problems(replace(cost, **changes)):
                    out.append(changes)
    return sorted(out, key=len)


def covers(found: dict, changes: dict) -> bool:
    """Whether ``changes`` asks for everything ``found`` does (its flags, a stage at least as high): a
    refusal that names ``found`` need not name ``changes`` too."""
    flags = all(changes.get(f) for f in SWITCHES if found.get(f))
    return flags and changes.get("zero_stage", -1) >= found.get("zero_stage", -1)


def every_layout(cost: CostModel) -> Callable[[int], list[tuple[int, int]]]:
    """The (sp, cp) layouts a world offers the model: every one its heads allow."""
    return lambda world: ContextParallel().layouts(world, cost.model.heads, cost.model.kv_heads)


@dataclass(frozen=True)
class FitQuestion:
    """Does a pack length fit this run: its cost model (``run_settings.cost_model``), the (sp, cp) layouts a
    world offers (``layouts_of``), the margin left free, the device's capacity (default the GPU's memory),
    whether offload and MLP tiles may be used (``memory_settings``: False for a measured search), and the
    ``tool`` whose words the answer speaks."""

    cost: CostModel
    layouts_of: Callable[[int], list]
    margin: float = 0.0
    capacity: float | None = None
    memory_settings: bool = True
    tool: Tool = CONFIG
    whole_past: int | None = None  # past it only sp 1 (a longrope model's original positions)

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
        return fit_anywhere(profiler, pack_len, self.layouts(pack_len, cost.world), cost.model.layers, self.margin)

    def layouts(self, pack_len: int, world: int) -> list:
        """The (sp, cp) layouts ``world`` offers a level of ``pack_len`` (only sp 1 past ``whole_past``)."""
        return [as_layout(x) for x in layouts_at(self.layouts_of(world), pack_len, self.whole_past)]


def margin_lever(q: FitQuestion, pack_len: int) -> list[Lever]:
    """The largest margin (in tenths of a GiB, below the run's) with which ``pack_len`` fits, where one is kept:
    the search's own question asked at each margin (a smaller one only frees memory), by bisection."""
    fits = lambda tenths: replace(q, margin=tenths * GIB / 10).where(pack_len)  # noqa: E731
    if q.margin <= 0 or fits(0) is None:
        return []
    low, high = 0, math.ceil(q.margin / GIB * 10)  # fits at low, not at high (the run's own margin)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) is not None else (low, mid)
    where, spelled = fits(low), q.tool.spell("margin", f"{low / 10:.1f}")
    return [Lever(f"a margin of {low / 10:.1f} GiB ({spelled}: {where.describe(q.device_bytes)})", margin_gib=low / 10)]


def settings_lever(q: FitQuestion, pack_len: int) -> list[Lever]:
    """Offload and MLP tiles, when the search in use does not try them (a measured one)."""
    if q.memory_settings or (where := q.where(pack_len, memory_settings=True)) is None:
        return []
    text = f"{q.tool.spell('analytic')}, whose search tries offload and MLP tiles ({where.describe(q.device_bytes)})"
    return [Lever(text, analytic=True)]


def setting_levers(q: FitQuestion, pack_len: int) -> list[Lever]:
    """Each smallest change of Liger, optimizer offload and ZeRO stage with which ``pack_len`` fits."""
    out: list[Lever] = []
    for changes in setting_changes(q.cost):
        if any(covers(lever.changes, changes) for lever in out):
            continue
        if (where := q.where(pack_len, replace(q.cost, **changes))) is not None:
            out.append(Lever(f"{q.tool.spell_all(changes)}: {where.describe(q.device_bytes)}", changes))
    return out


def gpu_lever(q: FitQuestion, pack_len: int) -> list[Lever]:
    """The fewest GPUs (doubling the world, up to ``MAX_LEVER_GPUS``) with which ``pack_len`` fits: with the
    run's settings, else with the most relief set-up accepts (every flag, the highest ZeRO stage beside them)
    where that alone does not make it fit on the run's GPUs."""
    changes = setting_changes(q.cost)
    most = max(changes, key=lambda c: (sum(bool(c.get(f)) for f in SWITCHES), c.get("zero_stage", 0)), default=None)
    for extra in ({}, most) if most else ({},):
        if extra and q.where(pack_len, replace(q.cost, **extra)) is not None:
            return []  # a setting lever already makes it fit on these GPUs
        world = 2 * q.cost.world
        while world <= MAX_LEVER_GPUS:
            if (where := q.where(pack_len, replace(q.cost, **extra, world=world))) is not None:
                also = f" with {q.tool.spell_all(extra)}" if extra else ""
                text = f"{world} GPUs{also} ({q.tool.spell('world', world)}: {where.describe(q.device_bytes)})"
                return [Lever(text, {**extra, "world": world})]
            world *= 2
    return []


def shorter_lever(q: FitQuestion, pack_len: int, lengths) -> list[Lever]:
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
    return [Lever(f"a largest level of {shorter:,} tokens ({q.tool.spell('max_len', shorter)}{left})", max_len=shorter)]


def levers(q: FitQuestion, pack_len: int, lengths=None) -> list[Lever]:
    """What would make ``pack_len`` fit, each found by running the memory search with it, in the order
    a user reaches for them (``margin_lever``, ``settings_lever``, ``setting_levers``, ``gpu_lever``,
    ``shorter_lever``)."""
    return (
        margin_lever(q, pack_len)
        + settings_lever(q, pack_len)
        + setting_levers(q, pack_len)
        + gpu_lever(q, pack_len)
        + shorter_lever(q, pack_len, lengths)
    )


def most_tiles(cost: CostModel, pack_len: int, sp: int) -> int:
    """The most MLP tiles the search tries at this level, 1 where set-up refuses tiles."""
    return min(TILE_STEPS[-1], pack_len // sp) if refusal("mlp_tiles", cost) is None else 1


def closest(q: FitQuestion, pack_len: int) -> str:
    """How far the run falls short: the least predicted peak over the layouts, with every layer
    checkpointed (offloaded, in the most tiles, where the search may)."""
    cost, layers = q.cost, q.cost.model.layers
    rows = []
    for sp, cp in q.layouts(pack_len, cost.world):
        if pack_len % sp:
            continue
        tiles = most_tiles(cost, pack_len, sp) if q.memory_settings else 1
        rows.append((cost.memory_bytes(pack_len, sp, layers, 1, q.memory_settings, tiles, cp), sp, cp, tiles))
    if not rows:
        return f"no sp of {cost.world} GPUs divides it"
    memory, sp, cp, tiles = min(rows)
    how = ", offloaded" + (f", {tiles} MLP tiles" if tiles > 1 else "") if q.memory_settings else ""
    layout = f"sp {sp}" + (f" = ulysses {sp // cp} x cp {cp}" if cp > 1 else "")
    return f"at best {memory / GIB:.1f} GiB per GPU at {layout} with all {layers} layers checkpointed{how}; {to_use(q)}"


def to_use(q: FitQuestion) -> str:
    """The memory a level may take, the margin named where one is kept free (its lever: a smaller margin)."""
    if q.margin <= 0:
        return f"{q.device_bytes / GIB:.1f} GiB to use"
    return (
        f"{(q.device_bytes - q.margin) / GIB:.1f} GiB to use ({q.device_bytes / GIB:.1f} less the margin of "
        f"{q.margin / GIB:.1f} GiB kept free, margin_gib)"
    )


def samples(n: int) -> str:
    return f"{n:,} sample" + ("" if n == 1 else "s")


def static_note(q: FitQuestion) -> str:
    """Why nothing fits at all: what the parameters, gradients and Adam states take before any token."""
    static = q.cost.static_bytes()
    return (
        f"the parameters, gradients and Adam states{' (and autocast weight copies)' if q.cost.autocast else ''} "
        f"alone take {static / GIB:.1f} GiB per GPU under "
        f"ZeRO-{q.cost.zero_stage} on {q.cost.world} GPUs, {to_use(q)}: a smaller model"
    )


class NoLevelFits(ConfigError):
    """The longest sample fits no level this run can train. The message (one line) says how far the
    run falls short and names the levers that would make it fit; ``pack_len`` and ``levers`` (``Lever``s)
    carry them for callers. A ConfigError: ``fit`` ends with it in one line and exit 2, as the tools do."""

    def __init__(self, message: str, pack_len: int, found: list[Lever]):
        super().__init__(message)
        self.pack_len, self.levers = pack_len, found

    def __reduce__(self):
        """Pickled whole: the measured search's processes hand it to the one that launched them."""
        return type(self), (str(self), self.pack_len, self.levers)


def run_flags(q: FitQuestion) -> str:
    """`` with --liger --offload-optimizer``: the run's own switches, as the tool spells them."""
    on = {f: True for f in SWITCHES if getattr(q.cost, f)}
    return f" with {q.tool.spell_all(on)}" if on else ""


def no_level_fits(q: FitQuestion, pack_len: int, lengths=None) -> NoLevelFits:
    """The error for a largest level of ``pack_len`` that fits no layout of the run, naming the levers."""
    hw, world = q.cost.hardware, q.cost.world
    longest = f"the longest sample ({int(np.max(lengths)):,} tokens) needs " if lengths is not None else ""
    found = levers(q, pack_len, lengths)
    fix = "it fits with " + "; or ".join(map(str, found)) if found else f"no lever makes it fit: {static_note(q)}"
    where = f"{world} x {hw.name} at ZeRO-{q.cost.zero_stage}{run_flags(q)} ({closest(q, pack_len)})"
    fits = f"fits no sp of {where}"
    if q.whole_past is not None and pack_len > q.whole_past:  # a longrope model: sp 1 only past its positions
        fits = f"past the model's longrope positions ({q.whole_past:,}) runs at sp 1 only, and fits on none of {where}"
    return NoLevelFits(f"{longest}a {pack_len:,}-token level, which {fits}: {fix}", pack_len, found)


def why_not_fits(cost: CostModel, level: Level) -> str:
    """What a level given to ``python -m lit_hbp.simulate`` needs beyond the device with every layer
    checkpointed, offloaded and the MLP in the most tiles the search tries: the parts of its predicted
    memory, largest first; then the levers that make it fit (a larger sp, Liger, optimizer offload, a higher
    ZeRO stage), each found by the search."""
    hw = cost.hardware
    tiles = most_tiles(cost, level.pack_len, level.sp)
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
    larger = FitQuestion(cost, lambda w: [x for x in every_layout(cost)(w) if x[0] > level.sp], tool=SIMULATE)
    here = FitQuestion(cost, lambda w: [(level.sp, cp)], tool=SIMULATE)
    wider = larger.where(level.pack_len)
    found = [f"a larger sp ({wider.describe(hw.memory_bytes)})"] if wider else []
    found += [str(lever) for lever in setting_levers(here, level.pack_len)]
    fix = "it fits with " + "; or ".join(found) + "; or make it shorter" if found else "make it shorter"
    tiled = f" and {tiles} MLP tiles" if tiles > 1 else ""
    return (
        f"{total / GIB:.1f} GiB per GPU predicted with all {layers} layers checkpointed and offloaded{tiled}, "
        f"the {hw.name} has {hw.memory_bytes / GIB:.1f} GiB ({top} GiB): {fix}"
    )

"""Price a plan's epoch on a cluster with the cost model (numpy only).

Every micro-step, every SP group's ranks run the cost model on their packs (dense, attention, and
the SP communication: Ulysses all-to-alls and context parallelism's all-gathers, priced apart); the
micro-step lasts as long as its slowest group and the other ranks wait (idle). Inside a group with
context parallelism the micro-batch is split over the CP ranks as training splits it
(``split_pack``), and its attention is priced at the busiest CP rank's causal area: the all-gathers
of every layer make the other CP ranks wait for it. Plans are compared as the same training recipe
packed differently: the same global batch in tokens, hence the same number of optimizer steps, each
adding one gradient synchronization. Summed, this is the epoch's wall time; times the world size, its GPU-hours.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from lit_hbp.autoselect.levers import why_not_fits
from lit_hbp.autoselect.memory_fit import fit_memory
from lit_hbp.autoselect.profiler import AnalyticProfiler
from lit_hbp.autoselect.search import Selection
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.packing import DEFAULT_PACKER, Level, Plan, plan_hbp, plan_single_level
from lit_hbp.packing.bins import Bins
from lit_hbp.packing.context_split import split_micro_batch
from lit_hbp.packing.metrics import group_index
from lit_hbp.packing.mixer_share import mixer_tokens

PARTS = ("dense", "attention", "vision", "sp_comm", "offload")
COMM_PARTS = ("ulysses_comm", "cp_comm")
"""The two collective families sp_comm is made of."""
SHARES = ("dense", "attention", "vision", *COMM_PARTS, "offload")
"""What ``Simulation.breakdown`` splits the busy GPU time into."""


@dataclass
class Simulation:
    """Per SP group of every micro-step: its level, micro-step and seconds of each part; per
    micro-step the wall time (slowest group)."""

    name: str
    plan: Plan
    cost: CostModel
    group_micro: np.ndarray
    group_sp: np.ndarray
    parts: dict[str, np.ndarray]
    micro_seconds: np.ndarray
    grad_sync: float
    optimizer_steps: int
    group_cp: np.ndarray
    group_cp_imbalance: np.ndarray
    """Per group: its CP degree, and max / mean causal attention area over its CP ranks (1 without CP)."""

    @property
    def seconds(self) -> float:
        return float(self.micro_seconds.sum() + self.optimizer_steps * self.grad_sync)

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.plan.world_size / 3600

    def idle(self) -> np.ndarray:
        """Seconds each group's ranks wait for the slowest group of their micro-step."""
        return self.micro_seconds[self.group_micro] - self.parts["total"]

    def cp_abr(self) -> float:
        """Attention balance inside the SP groups with CP, the plan's ABR taken over CP ranks instead
        of groups: mean over those groups of (max - mean) / max area (0 when no level has CP)."""
        cp = self.group_cp_imbalance[self.group_cp > 1]
        return float((1.0 - 1.0 / cp).mean()) if cp.size else 0.0

    def breakdown(self) -> dict[str, float]:
        """Share of all GPU time spent on each part (rank-weighted; SP communication as its Ulysses and
        CP parts), idle and gradient sync: the shares add up to 1."""
        weight = self.group_sp.astype(np.float64)  # a group's time is spent on sp ranks
        gpu_seconds = self.seconds * self.plan.world_size
        out = {p: float((self.parts[p] * weight).sum() / gpu_seconds) for p in SHARES}
        out["idle"] = float((self.idle() * weight).sum() / gpu_seconds)
        out["grad_sync"] = float(self.optimizer_steps * self.grad_sync * self.plan.world_size / gpu_seconds)
        return out


def pack_extra(plan: Plan, extra_work) -> np.ndarray:
    """Per pack of ``plan``, its samples' extra work (``plan_hbp``'s units: squared lengths)."""
    extra = np.asarray(extra_work, dtype=np.float64)
    sizes = np.diff(plan.offsets)
    out = np.zeros(sizes.size)
    full = sizes > 0
    if plan.members.size:
        out[full] = np.add.reduceat(extra[plan.members], plan.offsets[:-1][full])
    return out


def simulate(
    plan: Plan, cost: CostModel, name: str = "", global_batch_tokens: float | None = None, extra_work=None
) -> Simulation:
    """Price every micro-step of ``plan`` with ``cost`` (its world must be the plan's). The epoch
    takes ceil(tokens / global_batch_tokens) optimizer steps (default: the plan's own steps).
    ``extra_work``: per sample, work beside the language model's (a vision-language sample's image
    encoding, ``plan_hbp``'s units), priced as the vision tower's part (``CostModel.vision_seconds``: split
    over the SP group)."""
    if cost.world != plan.world_size:
        raise ValueError(f"cost model world {cost.world} != plan world {plan.world_size}")
    g = group_index(plan)
    n = g["n_groups"]
    group_cp = np.array([lv.layout[1] for lv in plan.levels], dtype=np.int64)[g["group_level"]]
    imbalance = cp_imbalance(plan, g, group_cp)
    tokens = np.bincount(g["group_of_pack"], weights=plan.pack_tokens, minlength=n) / g["group_sp"]
    attention = plan.pack_attention  # a model's sliding windows and chunks bound a long document's (document_sq)
    if cost.model.attention_windows:
        attention = Bins(plan.members, plan.offsets).loads(cost.model.document_sq(plan.lengths))
    sum_sq = np.bincount(g["group_of_pack"], weights=attention, minlength=n) * imbalance
    vision = np.zeros(n)
    if extra_work is not None:
        vision = np.bincount(g["group_of_pack"], weights=pack_extra(plan, extra_work), minlength=n)
    mixing = mixer_loads(plan, g, cost.model.mixer_heads) if cost.model.mixing else tokens
    parts = {p: np.zeros(n) for p in (*PARTS, *COMM_PARTS, "total")}
    for i, lv in enumerate(plan.levels):
        sel = g["group_level"] == i
        kind = cost if lv.sp_kind == cost.sp_kind else replace(cost, sp_kind=lv.sp_kind)  # the level's own traffic
        step = kind.micro_step(
            tokens[sel], sum_sq[sel], lv.sp, lv.ckpt_layers, lv.layout[1], lv.offload, lv.mlp_tiles, vision[sel],
            mixing[sel],
        )  # fmt: skip
        for key, value in step.items():
            parts[key][sel] = value
    micro = np.zeros(g["n_micro"])
    np.maximum.at(micro, g["micro_of_group"], parts["total"])
    steps = plan.n_steps
    if global_batch_tokens:
        steps = int(np.ceil(plan.pack_tokens.sum() / global_batch_tokens))
    return Simulation(
        name,
        plan,
        cost,
        g["micro_of_group"],
        g["group_sp"],
        parts,
        micro,
        cost.grad_sync_seconds(plan.accumulate),
        steps,
        group_cp,
        imbalance,
    )


def _group_packs(g: dict) -> tuple[np.ndarray, np.ndarray]:
    """The packs of every SP group (``order[first[i]:first[i + 1]]``: group i's, in plan order)."""
    order = np.argsort(g["group_of_pack"], kind="stable")
    first = np.r_[0, np.cumsum(np.bincount(g["group_of_pack"], minlength=g["n_groups"]))]
    return order, first


def mixer_loads(plan: Plan, g: dict, heads: int | None) -> np.ndarray:
    """Per SP group: the tokens, at full width, its busiest rank runs through each of a hybrid's stateful
    mixers (``mixer_share.mixer_tokens`` of the micro-batch's documents: those the packed call shares, splits
    by ``heads`` or runs on every rank, its batches' padding included; a group of one rank, its documents)."""
    out = np.zeros(g["n_groups"])
    order, first = _group_packs(g)
    for grp in range(g["n_groups"]):
        packs = order[first[grp] : first[grp + 1]]
        docs = plan.lengths[np.concatenate([plan.pack(p) for p in packs])]
        out[grp] = mixer_tokens(docs.tolist(), int(g["group_sp"][grp]), heads)
    return out


def cp_imbalance(plan: Plan, g: dict, group_cp: np.ndarray) -> np.ndarray:
    """Per SP group: max / mean causal attention area over its CP ranks, 1 for groups without CP.

    The micro-batch is split the way training splits it: its packs' documents in order, padded by
    collate to a multiple of lcm(8, sp) (at least one) with a padding segment of its own (which
    costs attention like a document), cut by ``split_pack``. Only CP groups are split (one per long micro-batch)."""
    out = np.ones(g["n_groups"])
    cp_groups = np.flatnonzero(group_cp > 1)
    if not cp_groups.size:
        return out
    order, first = _group_packs(g)
    for grp in cp_groups.tolist():
        packs = order[first[grp] : first[grp + 1]]
        docs = plan.lengths[np.concatenate([plan.pack(p) for p in packs])]
        out[grp] = split_micro_batch(docs, int(g["group_sp"][grp]), int(group_cp[grp])).imbalance()
    return out


def fill_checkpointing(levels, cost: CostModel, lengths, margin: float = 0.0) -> list[Level]:
    """Give every level the fewest checkpointed layers that fit in memory (Algorithm 4), then, when
    every layer checkpointed is not enough, offload and MLP tiles (``fit_memory``)."""
    profiler = AnalyticProfiler(cost, lengths)
    out = []
    for lv in levels:
        fit, _ = fit_memory(profiler, lv.pack_len, lv.sp, 0, cost.model.layers, margin, lv.layout[1])
        if fit is None:
            raise ValueError(f"level {lv.pack_len} sp {lv.sp}{lv.layout_note} does not fit: {why_not_fits(cost, lv)}")
        out.append(replace(lv, ckpt_layers=fit.ckpt, offload=fit.offload, mlp_tiles=fit.tiles))
    return out


def price(runs: list[tuple[str, Plan]], cost: CostModel, extra_work=None) -> list[Simulation]:
    """Simulate named plans as one training recipe: every plan at the first one's global batch
    (tokens per optimizer step), so each takes the optimizer steps its tokens need; ``extra_work``
    (per sample) is priced in every plan alike, whatever each plan knew of it."""
    first = runs[0][1]
    batch = first.pack_tokens.sum() / first.n_steps
    return [simulate(plan, cost, name, batch, extra_work) for name, plan in runs]


def compare(
    lengths,
    cost: CostModel,
    levels,
    accumulate: int = 1,
    seed: int = 0,
    packer: str = DEFAULT_PACKER,
    over_length: str = "drop",
) -> list[Simulation]:
    """Simulate (a) naive single-level ISF at the largest level, (b) the levels without the balance
    sort, (c) full HBP with the levels, at the naive plan's global batch."""
    world, levels = cost.world, list(levels)
    return price(
        [
            (
                "naive ISF",
                plan_single_level(lengths, levels[-1], world, accumulate, seed, "isf", over_length=over_length),
            ),
            (
                "hierarchical, no balance",
                plan_hbp(lengths, levels, world, accumulate, seed, packer, over_length=over_length, balance=False),
            ),
            ("HBP", plan_hbp(lengths, levels, world, accumulate, seed, packer, over_length=over_length)),
        ],
        cost,
    )


def compare_auto(
    lengths, cost: CostModel, selection: Selection, accumulate: int = 1, seed: int = 0, packer: str = DEFAULT_PACKER
) -> list[Simulation]:
    """Simulate naive ISF at the auto-selected largest level and (d) HBP with the auto-selected levels,
    at the naive plan's global batch: the speed-up of the search's plan over packing the same samples
    naively. Samples above a capped largest level (``max_len``) are dropped from both, as the notes say."""
    levels, world = selection.levels, cost.world
    top = levels[-1]
    return price(
        [
            (
                f"naive ISF at {top.pack_len}",
                plan_single_level(lengths, top, world, accumulate, seed, "isf", over_length="drop"),
            ),
            (
                "HBP, auto-selected levels",
                plan_hbp(lengths, levels, world, accumulate, seed, packer, over_length="drop"),
            ),
        ],
        cost,
    )

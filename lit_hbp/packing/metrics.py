"""Packing metrics of a plan (docs/design.md section 4), vectorized over micro-steps.

Per micro-step, every rank i holds T_i tokens and A_i attention work. An SP group of size s puts
T/s tokens of its packs on each of its ranks, and Ulysses gives each rank 1/s of the group's
attention (heads are split), so A_i = (sum of squared sample lengths of the group's packs) / s.

    DBR = sum_i (T_max - T_i) / (T_max * N)     ABR = sum_i (A_max - A_i) / (A_max * N)

both averaged over micro-steps (a micro-step with no tokens at all counts as balanced: its cost
shows in PR). PR is the share of pack capacity left empty over all packs, empty completions
included; ``fill`` is the same over the real packs only (the packer's quality). CR is the share
of tokens processed with sp > 1, and Ave-T the mean over micro-steps of the mean T_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from lit_hbp.packing.levels import Level


class PackLayout(Protocol):
    """What the metrics read of a plan (``lit_hbp.packing.Plan`` is one): its packs in step ->
    micro-step -> SP group -> slot order, with their level, tokens, attention work and capacity."""

    levels: Sequence[Level]
    world_size: int
    accumulate: int
    offsets: np.ndarray
    step_offsets: np.ndarray
    n_steps: int
    n_micro_steps: int
    pack_level: np.ndarray
    pack_tokens: np.ndarray
    pack_attention: np.ndarray
    pack_capacity: np.ndarray


def _imbalance(per_group: np.ndarray, micro_of_group: np.ndarray, n_micro: int) -> np.ndarray:
    """mean over groups of (max - x) / max, per micro-step (groups of one micro-step are equal-sized)."""
    peak = np.zeros(n_micro)
    np.maximum.at(peak, micro_of_group, per_group)
    gap = np.where(peak[micro_of_group] > 0, 1.0 - per_group / np.where(peak > 0, peak, 1.0)[micro_of_group], 0.0)
    counts = np.bincount(micro_of_group, minlength=n_micro)
    return np.bincount(micro_of_group, weights=gap, minlength=n_micro) / np.maximum(counts, 1)


def group_index(plan: PackLayout) -> dict:
    """Where every pack sits: its SP group of its micro-step, and per group the micro-step, level
    and sp. Packs are laid out step -> micro-step -> group -> B slots, so a group is B consecutive
    packs and a micro-step is N / sp consecutive groups."""
    n_packs = plan.offsets.size - 1
    sp = np.array([lv.sp for lv in plan.levels], dtype=np.int64)
    bsz = np.array([lv.packs_per_rank for lv in plan.levels], dtype=np.int64)
    level = plan.pack_level
    step_of_pack = np.repeat(np.arange(plan.n_steps), np.diff(plan.step_offsets))
    local_group = (np.arange(n_packs) - plan.step_offsets[step_of_pack]) // bsz[level]
    micro_id = step_of_pack * plan.accumulate + local_group // (plan.world_size // sp[level])
    first = np.r_[True, (local_group[1:] != local_group[:-1]) | (step_of_pack[1:] != step_of_pack[:-1])]
    group_id = np.cumsum(first) - 1
    n_groups = int(group_id[-1]) + 1 if n_packs else 0
    group_level = np.zeros(n_groups, dtype=np.int64)
    group_level[group_id] = level
    micro_of_group = np.zeros(n_groups, dtype=np.int64)
    micro_of_group[group_id] = micro_id
    return dict(
        group_of_pack=group_id,
        n_groups=n_groups,
        group_level=group_level,
        group_sp=sp[group_level],
        micro_of_group=micro_of_group,
        n_micro=plan.n_micro_steps,
    )


def plan_metrics(plan: PackLayout) -> dict:
    """DBR, ABR, PR, CR, Ave-T, fill, and step/pack counts of a plan."""
    n_packs = plan.offsets.size - 1
    sp = np.array([lv.sp for lv in plan.levels], dtype=np.int64)
    if n_packs == 0:
        return dict(dbr=0.0, abr=0.0, pr=0.0, cr=0.0, ave_t=0.0, fill=0.0, n_steps=0, n_packs=0, n_empty_packs=0)
    level = plan.pack_level
    g = group_index(plan)
    group_id, n_groups, micro_of_group, n_micro = g["group_of_pack"], g["n_groups"], g["micro_of_group"], g["n_micro"]
    tokens = plan.pack_tokens.astype(np.float64)
    attention = plan.pack_attention
    t_rank = np.bincount(group_id, weights=tokens, minlength=n_groups) / g["group_sp"]
    a_rank = np.bincount(group_id, weights=attention, minlength=n_groups) / g["group_sp"]
    micro_id = micro_of_group[group_id]

    capacity = plan.pack_capacity.astype(np.float64)
    real = plan.offsets[1:] > plan.offsets[:-1]
    total_tokens = tokens.sum()
    # Mean T_i over the N ranks of a micro-step = tokens of the micro-step / N.
    micro_tokens = np.bincount(micro_id, weights=tokens, minlength=n_micro)
    return dict(
        dbr=float(_imbalance(t_rank, micro_of_group, n_micro).mean()),
        abr=float(_imbalance(a_rank, micro_of_group, n_micro).mean()),
        pr=float(1.0 - total_tokens / capacity.sum()),
        cr=float(tokens[sp[level] > 1].sum() / total_tokens) if total_tokens else 0.0,
        ave_t=float((micro_tokens / plan.world_size).mean()),
        fill=float(tokens[real].sum() / capacity[real].sum()) if real.any() else 0.0,
        n_steps=int(plan.n_steps),
        n_packs=int(real.sum()),
        n_empty_packs=int((~real).sum()),
    )

"""Sequence-parallel topology: a level of degree sp splits the world into contiguous rank blocks.

Pure Python on purpose: the planner (numpy only) and the strategy (torch.distributed) both call
these, so data placement and process groups can never disagree.
"""

from __future__ import annotations

from lit_hbp.packing.levels import sp_coords  # noqa: F401  (the planner's: ranks of an SP group)


def sp_group_ranks(world_size: int, sp: int) -> list[list[int]]:
    """Ranks of every SP group of degree ``sp``: group g = [g*sp, (g+1)*sp)."""
    if sp < 1 or world_size % sp:
        raise ValueError(f"sp {sp} must be >= 1 and divide world_size {world_size}")
    return [list(range(g * sp, (g + 1) * sp)) for g in range(world_size // sp)]


def layout_coords(sp_rank: int, ulysses: int) -> tuple[int, int]:
    """(CP rank, Ulysses rank) of a rank of an SP group laid out as ulysses x cp: Ulysses groups
    are contiguous (inside a node), CP groups strided across them."""
    return sp_rank // ulysses, sp_rank % ulysses


def cp_group_ranks(world_size: int, sp: int, cp: int) -> list[list[int]]:
    """Ranks of every CP group of the layout (sp / cp) x cp: in SP group g, the ranks with the same
    Ulysses rank u are g*sp + u + j*(sp / cp), j < cp."""
    if cp < 1 or sp % cp:
        raise ValueError(f"cp {cp} must be >= 1 and divide sp {sp}")
    u = sp // cp
    return [[g * sp + r + j * u for j in range(cp)] for g in range(world_size // sp) for r in range(u)]


def heads_problem(num_heads: int, num_kv_heads: int, ulysses: int) -> str | None:
    """Why the heads cannot be split over ``ulysses`` ranks by the all-to-all (kv heads may be
    replicated up to the degree), or None when they can."""
    if num_heads % ulysses:
        return (
            f"{num_heads} attention heads cannot be split over {ulysses} Ulysses ranks: heads must be divisible by it"
        )
    if num_kv_heads % ulysses and ulysses % num_kv_heads:
        return (
            f"{num_kv_heads} key/value heads do not fit {ulysses} Ulysses ranks: kv heads must be divisible by it, "
            "or it divisible by kv heads (then kv heads are replicated)"
        )
    return None


def kv_slice(num_kv_heads: int, cp: int) -> int:
    """kv heads per CP all-gather: the largest divisor of the kv heads not above kv / cp, so a gathered
    slice (cp ranks' tokens) is no larger than the rank's own K/V."""
    most = max(1, num_kv_heads // cp)
    return max(d for d in range(1, most + 1) if num_kv_heads % d == 0)


def cp_slices(num_kv_heads: int, ulysses: int, cp: int) -> int:
    """How many kv-head slices a CP rank gathers in turn: the kv heads it holds after the Ulysses
    all-to-all (one, replicated, when there are fewer than the Ulysses degree) over ``kv_slice``."""
    local = max(1, num_kv_heads // ulysses)
    return local // kv_slice(local, cp)


def default_layout(sp: int, num_heads: int, num_kv_heads: int, node_size: int | None = None) -> tuple[int, int]:
    """(ulysses, cp) for ``sp``: Ulysses on the largest divisor of sp the heads allow and, given the
    ranks per node ``node_size``, no larger than a node (its all-to-all moves the least inside a
    node, while across nodes CP's all-gather is cheaper: ``lit_hbp.cost.costmodel``), context
    parallelism on the rest, across the nodes."""
    most = sp if node_size is None else max(1, min(sp, node_size))
    u = max(d for d in range(1, most + 1) if sp % d == 0 and heads_problem(num_heads, num_kv_heads, d) is None)
    return u, sp // u


def resolve_layout(level, num_heads: int, num_kv_heads: int, node_size: int | None = None):
    """``level`` with its (ulysses, cp) filled in for a model of these heads on nodes of
    ``node_size`` ranks (unchanged when it gives one, or names a kind of its own)."""
    from dataclasses import replace

    from lit_hbp.packing.levels import LAYOUT_KINDS

    if level.cp is not None or level.sp_kind not in LAYOUT_KINDS:
        return level
    u, cp = default_layout(level.sp, num_heads, num_kv_heads, node_size)
    return replace(level, ulysses=u, cp=cp, sp_kind=LAYOUT_KINDS[1] if cp > 1 else LAYOUT_KINDS[0])


def model_heads(config) -> tuple[int, int]:
    """(query heads, key/value heads) of a transformers config (a vision-language model's: its
    language model's, the one sequence parallelism splits)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def layout_levels(levels, config, node_size: int | None) -> tuple:
    """The levels with their (ulysses, cp) layouts resolved for the model of ``config`` on nodes of
    ``node_size`` ranks (the Trainer's ``num_devices``): the strategy, the data module and the
    self-check all call this pure function with the same arguments, so they agree."""
    heads, kv = model_heads(config)
    return tuple(resolve_layout(lv, heads, kv, node_size) for lv in levels)

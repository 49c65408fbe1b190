"""Sequence-parallel topology: a level of degree sp splits the world into contiguous rank blocks.

Pure Python on purpose: the planner (numpy only) and the strategy (torch.distributed) both call
these, so data placement and process groups can never disagree.
"""

from __future__ import annotations


def sp_group_ranks(world_size: int, sp: int) -> list[list[int]]:
    """Ranks of every SP group of degree ``sp``: group g = [g*sp, (g+1)*sp)."""
    if sp < 1 or world_size % sp:
        raise ValueError(f"sp {sp} must be >= 1 and divide world_size {world_size}")
    return [list(range(g * sp, (g + 1) * sp)) for g in range(world_size // sp)]


def sp_coords(rank: int, sp: int) -> tuple[int, int]:
    """(SP group index, rank inside the group) of a global rank under degree ``sp``."""
    return rank // sp, rank % sp
